"""Where the trainer keeps its checkpoints, and what makes one complete (controller side, pure file logic).

Layout: `<checkpoint.dir>/step_000020/{actor,critic}/` (Megatron distributed checkpoints with the optimizer state,
each written atomically by `megarl.checkpoint.dist_ckpt`), `rng/<pool>_rank<r>.pt` (every worker process's random
number generators), `controller_state.pt` (the controller's Stateful objects: loop, data loader, rollout schedule,
KL controller, its RNG) and `trainer_state.json` (format, step, the job config: the human-readable part). The
whole step directory is written by `megarl.trainer.checkpoint_manager.CheckpointManager` under a temporary name
and renamed once complete; a step directory without `trainer_state.json` (an older megarl's crash mid-save) is
incomplete and never resumed from; `keep_last` prunes only complete ones, oldest first.

A resumed run compares its config with the one the checkpoint recorded (`config_changes`, `check_resume_config`):
changes that cannot alter the numbers pass, layout changes pass with a note (the checkpoint reshards; results
equal up to float rounding), anything else is refused unless `checkpoint.allow_config_change=true`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

from megarl.config import ConfigError
from megarl.config.loader import to_dict

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
    """`trainer_state.json` in `path` (JSON data), through a temporary file and a rename."""
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


# ----------------------------------------------------------------------------------------------- config changes
# Keys (dotted, fnmatch-free prefixes) whose change cannot alter what the following steps compute.
NEUTRAL_KEYS = (
    "checkpoint.", "logging.", "trainer.log_every", "trainer.val_every", "trainer.max_skipped_steps",
    "data.val_path", "rollout.val_temperature", "rollout.verify_sync", "rollout.reshard_bucket_mb",
    "reward.timeout_s", "reward.on_error", "reward.max_error_fraction", "resources.heartbeat_timeout_s",
    "resources.call_timeout_s",
)
NEUTRAL_SUFFIXES = (".offload.params", ".offload.grads", ".offload.optimizer")
# Keys that only change how the same computation is laid out (Megatron layouts, pools, micro-batching, threads):
# the checkpoint reshards, and the numbers equal the uninterrupted run's up to float rounding (reduction order).
LAYOUT_KEYS = ("resources.pools.", "resources.threads_per_worker")
LAYOUT_SUFFIXES = (".parallel.tp", ".parallel.pp", ".parallel.cp", ".parallel.dp", ".parallel.first_stage_layers",
                   ".parallel.last_stage_layers", ".parallel.vpp", ".pool", ".micro_batch_samples",
                   ".micro_batch_tokens")
TRAINED_ROLES = ("actor", "critic")


def config_record(cfg) -> dict:
    """The job config as JSON data (what `trainer_state.json` records under "config")."""
    return json.loads(json.dumps(to_dict(cfg)))


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: data}


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for every leaf that differs, sorted by key ('<absent>' for a key one
    side lacks)."""
    a, b = _flatten(saved), _flatten(current)
    out = []
    for k in sorted(set(a) | set(b)):
        old, new = a.get(k, "<absent>"), b.get(k, "<absent>")
        if old != new:
            out.append((k, old, new))
    return out


def change_kind(key: str, current: dict) -> str:
    """'neutral' (cannot change the numbers), 'layout' (equal up to float rounding) or 'breaking'.

    `trainer.total_steps` sets the length of a cosine LR decay: neutral only when every trained role's schedule is
    constant. `current`: the new config as `config_record` data."""
    if key.startswith(NEUTRAL_KEYS) or key.endswith(NEUTRAL_SUFFIXES):
        return "neutral"
    if key == "trainer.total_steps":
        schedules = [current.get(r, {}).get("optimizer", {}).get("lr_schedule") for r in TRAINED_ROLES
                     if r == "actor" or current.get(r, {}).get("enabled")]
        return "neutral" if all(s == "constant" for s in schedules) else "breaking"
    if key.startswith(LAYOUT_KEYS) or key.endswith(LAYOUT_SUFFIXES):
        return "layout"
    return "breaking"


def check_resume_config(saved: Optional[dict], cfg, where: str) -> list[str]:
    """Compare the config recorded in a checkpoint (`saved`, None for checkpoints that predate the record) with the
    current one. Returns the lines to log; raises `ConfigError` naming every exactness-breaking change unless
    `checkpoint.allow_config_change`."""
    if saved is None:
        return [f"{where} records no config (an older checkpoint): changes since cannot be checked"]
    current = config_record(cfg)
    changes = config_changes(saved, current)
    kinds = {key: change_kind(key, current) for key, _, _ in changes}
    lines = [f"config change since {where}: {k}: {a!r} -> {b!r} ({kinds[k]})" for k, a, b in changes]
    breaking = [f"{k}: {a!r} -> {b!r}" for k, a, b in changes if kinds[k] == "breaking"]
    if breaking and not cfg.checkpoint.allow_config_change:
        raise ConfigError(
            f"checkpoint.allow_config_change: resuming from {where} with config changes that break an exact resume: "
            + "; ".join(breaking) + ". Restore these values, or set checkpoint.allow_config_change=true to resume "
            "with them anyway (the run then differs from an uninterrupted one)"
        )
    return lines


def refuse_breaking_resume(cfg) -> None:
    """Before Ray and the workers start: when this run would resume (`checkpoint.dir` holds a complete checkpoint and
    `checkpoint.resume`), raise the `ConfigError` of `check_resume_config` for an exactness-breaking config change
    now, from the files alone, so a refused resume costs no start-up. `RLLoop` checks (and logs) again at resume."""
    ckpt = cfg.checkpoint
    if not ckpt.dir or not ckpt.resume:
        return
    path = latest(ckpt.dir)
    if path is not None:
        from megarl.trainer.checkpoint_manager import check_format

        state = read_state(path)
        check_format(path, state)
        check_resume_config(state.get("config"), cfg, path)
