"""One checkpoint of a run: the controller's state objects and the roles' distributed checkpoints, saved atomically.

Every piece of state the next step depends on saves itself. On the controller each is *Stateful*: `state_dict()`
returns plain data (dicts, lists, tuples, str, numbers, bools, None, tensors) and `load_state_dict(state)` restores
it; `CheckpointManager(states={"loop": loop, "loader": loader, "schedule": schedule, "kl": kl, "rng":
ProcessRNG()}, shards=[worker groups])` saves them all into one file, `controller_state.pt`, which loads with
`torch.load(weights_only=True)` (a checkpoint never runs code). The worker groups (`shards`) save their own part:
`save_checkpoint(step_dir)` / `load_checkpoint(step_dir)` write and read the roles' Megatron distributed
checkpoints (`actor/`, `critic/`: weights, optimizer, scheduler) and every worker's RNG (`rng/`).

Atomic: a step is written into `step_NNNNNN.tmp-saving` and renamed to `step_NNNNNN` once complete
(`megarl.checkpoint.atomic`), `trainer_state.json` (the human-readable part: format, step, the job config) last
inside it. A failure mid-save leaves only the `.tmp-saving` directory, never a step directory; the next save removes
it. Checkpoints of an older format (before `controller_state.pt`) are refused with what to do.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Optional, Protocol, Sequence

import torch

from megarl.checkpoint.atomic import commit_dir, make_temp_dir
from megarl.config import ConfigError
from megarl.trainer import checkpointing

logger = logging.getLogger("megarl.trainer")

CONTROLLER_STATE = "controller_state.pt"
FORMAT = 2  # 1: trainer_state.json held the loader / KL / skip streak, rollout_buffer.pt pickled (before issue 30)
TEMP_TOKEN = "saving"


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ShardedState(Protocol):
    """A worker group: its ranks save / load their own files under the step directory."""

    def save_checkpoint(self, step_dir: str) -> list[str]: ...

    def load_checkpoint(self, step_dir: str) -> list[str]: ...


class ProcessRNG:
    """This process's random number generators (Python `random`, numpy, torch CPU and CUDA) as a Stateful: the
    controller's (user reward functions may draw from them). Workers save theirs with their shards."""

    def state_dict(self) -> dict:
        from megarl.checkpoint.train_state import capture_rng

        return capture_rng(megatron=False)

    def load_state_dict(self, state: dict) -> None:
        from megarl.checkpoint.train_state import restore_rng

        restore_rng(state)


def check_plain(data: Any, where: str) -> None:
    """Raise TypeError naming the first value under `data` that is not plain data (what `torch.load` with
    weights_only=True could not read back): `where` is its path, e.g. "schedule.batches[0].records"."""
    if data is None or isinstance(data, (bool, int, float, str, torch.Tensor, torch.dtype)):
        return
    if isinstance(data, dict):
        for k, v in data.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; state keys must be str or int")
            check_plain(v, f"{where}.{k}")
        return
    if isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(data).__module__}.{type(data).__name__}, not plain data (dict, list, tuple, "
                    "str, number, bool, None, tensor): its state_dict must convert it")


def check_format(path: str, record: dict) -> None:
    """Refuse a complete checkpoint that this megarl cannot resume (an older format), saying what to do."""
    if record.get("format") != FORMAT or not os.path.isfile(os.path.join(path, CONTROLLER_STATE)):
        raise ConfigError(
            f"checkpoint.dir: {path} is a checkpoint of an older megarl (format {record.get('format', 1)}; this one "
            f"resumes format {FORMAT}, the controller's state in {CONTROLLER_STATE}) and is not resumed. Resume it "
            "with the megarl that wrote it, or start a new run in another checkpoint.dir; its weights still export "
            f"with `megarl export {path} --out HF_DIR`")


class CheckpointManager:
    """Saves and restores `states` (name -> Stateful, restored in this order) and `shards` (worker groups) as one
    checkpoint per step under a root directory (see the module docstring)."""

    def __init__(self, states: dict[str, Stateful], shards: Sequence[ShardedState] = ()) -> None:
        self.states = dict(states)
        self.shards = list(shards)

    def save(self, root: str, step: int, record: Optional[dict] = None, keep_last: int = 0) -> str:
        """Write step `step` into `root/step_NNNNNN`, atomically; `record`: JSON data for `trainer_state.json`
        beside the format and step (the job config). Then prune to the newest `keep_last` complete checkpoints (0:
        keep all). Returns the step directory. Refuses to overwrite a complete checkpoint."""
        path = checkpointing.step_dir(root, step)
        if step in checkpointing.complete_steps(root):
            raise RuntimeError(f"refusing to overwrite the complete checkpoint {path}")
        os.makedirs(root, exist_ok=True)
        self.remove_leftovers(root)
        tmp = make_temp_dir(path, TEMP_TOKEN)
        for shard in self.shards:
            shard.save_checkpoint(tmp)
        states = {name: obj.state_dict() for name, obj in self.states.items()}
        check_plain(states, "state")
        torch.save({"format": FORMAT, "step": int(step), "states": states}, os.path.join(tmp, CONTROLLER_STATE))
        checkpointing.write_state(tmp, {"format": FORMAT, "step": int(step), "states": list(states),
                                        **(record or {})})
        if os.path.exists(path):  # an incomplete save of this step by an older megarl (no trainer_state.json)
            shutil.rmtree(path)
        commit_dir(tmp, path)
        pruned = checkpointing.prune(root, keep_last)
        if pruned:
            logger.info("checkpoint.keep_last=%d: removed the checkpoints of steps %s", keep_last, pruned)
        return path

    def load(self, path: str) -> tuple[int, list[str]]:
        """Restore every shard and state from step directory `path`: (the step it ended, the names the shards
        loaded). Raises naming what is missing when the checkpoint lacks one of `states`."""
        check_format(path, checkpointing.read_state(path))
        saved = torch.load(os.path.join(path, CONTROLLER_STATE), weights_only=True)
        missing = [name for name in self.states if name not in saved["states"]]
        if missing:
            raise RuntimeError(f"{path}/{CONTROLLER_STATE} holds no state for {missing} (it has "
                               f"{sorted(saved['states'])}); it was written by another kind of run")
        loaded = [name for shard in self.shards for name in shard.load_checkpoint(path)]
        for name, obj in self.states.items():
            obj.load_state_dict(saved["states"][name])
        return int(saved["step"]), loaded

    @staticmethod
    def remove_leftovers(root: str) -> list[str]:
        """Delete the `step_*.tmp-saving` directories failed saves left under `root`; returns their names."""
        gone = sorted(n for n in os.listdir(root) if n.startswith("step_") and n.endswith(f".tmp-{TEMP_TOKEN}"))
        for name in gone:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        return gone
