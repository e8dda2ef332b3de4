"""Removing the shared-memory segments the workers' vLLM engines leave in /dev/shm.

vLLM creates a 24 MiB message-queue ring buffer (`psm_*`) per TP group and CPU communicator segments
(`*-cpushm_<rank>`), and unlinks them only when their Python objects are collected or the engine is closed. The
controller ends every run by killing its Ray workers (and a worker may die on its own), so neither happens. Each
worker reports its segments right after it started (`HybridWorker.shm_segments`); after the workers are gone the
controller unlinks those that are still there, on this host only (a worker on another node leaves its segments in
that node's /dev/shm; its own node's next engine removes the stale communicator segments, `vllm_adapter`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Iterable

logger = logging.getLogger("megarl.trainer")

SHM_DIR = "/dev/shm"


def remove_shm_segments(reports: Iterable[dict], shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments named in `reports` (one `{"host", "names"}` per worker) that live on this host and still
    exist; returns the names removed. Never raises: a failure is logged."""
    here = socket.gethostname()
    removed = []
    for report in reports:
        if not report or report.get("host") != here:
            continue
        for name in report.get("names", []):
            if "/" in name or name in ("", ".", ".."):
                continue  # only plain names inside shm_dir
            path = os.path.join(shm_dir, name)
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError as e:
                logger.warning("could not remove %s: %s", path, e)
    return removed
