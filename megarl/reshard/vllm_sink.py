"""The inference side of a reshard: deliver this rank's vLLM shards to a `VllmRolloutEngine`.

The executor writes each vLLM parameter shard (vLLM layout, this rank only, vocab padding rows zero) into a staging
tensor from `target`; `finish` hands them all to `engine.update_weights(..., layout="vllm_shard")`, which on the
CPU build goes through vLLM's layerwise reload (oneDNN repacking: the live parameters cannot be written directly)
and on GPU copies each shard into the engine's parameter in place; then the prefix cache is reset so no KV block
computed with old weights is reused. The staging holds one inference shard of the model (what this rank's
engine holds anyway); no rank ever holds a full TP-sharded parameter it does not need.

Delta mode (`persistent=True`): the staging tensors are kept between reshards, since delta mode writes only the
changed elements onto the previous shard and the CPU build's live parameters are repacked and cannot be read back.
Cost: one inference shard of the model (in the training dtype) held for the sink's lifetime, on top of the engine's
own copy; the default mode frees the staging after each `finish`.
"""

from __future__ import annotations

import torch


class VllmShardSink:
    """`WeightSink` feeding a rollout engine with `update_weights(iterable of (vLLM name, shard), "vllm_shard")`."""

    def __init__(self, engine, keep_fed: bool = False, persistent: bool = False) -> None:
        """`keep_fed=True` keeps the last shards fed in `last_fed` (tests compare them with vLLM's layout);
        `persistent=True` keeps the staging between reshards (delta mode)."""
        self.engine = engine
        self.keep_fed = keep_fed
        self.keeps_targets = persistent
        self.last_fed: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._done: list[str] = []
        # vLLM lists a tied lm_head once, under the embedding: shards it does not list are not fed.
        self._dtypes = {s.name: s.dtype for s in engine.param_shards()}
        self._known = set(self._dtypes)
        self.tensors_fed = 0

    def target(self, param: str, shape, dtype) -> torch.Tensor:
        if param not in self._known:
            raise KeyError(f"the rollout engine has no parameter {param!r}; it has e.g. {sorted(self._known)[:3]}")
        old = self._staged.get(param)
        if self.keeps_targets and old is not None and old.shape == tuple(shape) and old.dtype == dtype:
            return old
        t = torch.zeros(shape, dtype=dtype)
        self._staged[param] = t
        return t

    def commit(self, param: str) -> None:
        self._done.append(param)

    def finish(self) -> None:
        staged = [(name, self._staged[name].to(self._dtypes[name])) for name in self._done]
        missing = self._known - set(self._done)
        if missing:
            raise RuntimeError(f"reshard did not produce {len(missing)} vLLM parameter(s), e.g. {sorted(missing)[:3]}")
        self.tensors_fed = self.engine.update_weights(iter(staged), layout="vllm_shard")
        if self.keep_fed:  # persistent staging changes at the next reshard: keep copies
            self.last_fed = {n: t.clone() if self.keeps_targets else t for n, t in staged}
        if not self.keeps_targets:
            self._staged.clear()
        self._done.clear()
