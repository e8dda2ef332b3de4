"""Atomic output directories: write into `OUT.tmp-<token>`, rename to `OUT` when complete.

A crash leaves only a `*.tmp-*` directory, never one that looks like a finished checkpoint.
"""

from __future__ import annotations

import os
import shutil

from megarl.checkpoint.errors import CheckpointError


def check_output_dir(out: str, overwrite: bool) -> None:
    """Refuse an output directory that already holds files unless `overwrite`."""
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise CheckpointError(f"output path {out} exists and is not a directory")
        if os.listdir(out) and not overwrite:
            raise CheckpointError(f"output directory {out} already holds a checkpoint; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CheckpointError(f"parent directory {parent} of the output does not exist")


def temp_dir_for(out: str, token: int | str) -> str:
    return f"{os.path.abspath(out).rstrip(os.sep)}.tmp-{token}"


def make_temp_dir(out: str, token: int | str) -> str:
    tmp = temp_dir_for(out, token)
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    return tmp


def commit_dir(tmp: str, out: str) -> None:
    """Move the finished `tmp` into place at `out` (an existing `out` is replaced: the caller checked --overwrite)."""
    out = os.path.abspath(out)
    old = None
    if os.path.exists(out):
        old = f"{out}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
