"""Where the trainer keeps its checkpoints, and what makes one complete (controller side, pure file logic).

Layout: `<checkpoint.dir>/step_000020/{actor,critic}/` (Megatron distributed checkpoints, each written atomically
by `megarl.checkpoint.dist_ckpt`) plus `trainer_state.json` (step, data-loader position), written last through a
temporary file and a rename. A step directory without `trainer_state.json` is incomplete (a crash mid-save) and
is never resumed from; `keep_last` prunes only complete ones, oldest first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

STATE_FILE = "trainer_state.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, STATE_FILE)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest(root: str) -> Optional[str]:
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def write_state(path: str, state: dict) -> None:
    """`trainer_state.json` in `path`, atomically (the marker that the checkpoint is complete)."""
    tmp = os.path.join(path, STATE_FILE + f".tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, STATE_FILE))


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def prune(root: str, keep_last: int) -> list[int]:
    """Delete complete checkpoints beyond the newest `keep_last` (0 keeps all); returns the deleted steps."""
    if keep_last <= 0:
        return []
    steps = complete_steps(root)
    doomed = steps[:-keep_last]
    for s in doomed:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)
    return doomed
