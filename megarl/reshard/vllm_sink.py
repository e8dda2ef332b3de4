"""The inference side of a reshard: deliver this rank's vLLM shards to a `VllmRolloutEngine`.

Two ways a shard reaches the engine, chosen per parameter:

- **In place** (GPU): vLLM's CUDA parameters of unquantized dense models keep the loader layout after loading
  (vLLM 0.32 `UnquantizedLinearMethod.process_weights_after_loading` and the embedding's only repack on CPU/XPU),
  so `target` hands the executor the engine's live parameter (`engine.writable_params()`), shape and dtype
  permitting: the received bytes land in the engine's memory directly, with no staging copy, no host round trip
  and no reload call. Addresses do not change, so CUDA graphs captured by vLLM stay valid.
- **Staged** (CPU, or a parameter whose dtype/shape differs from what the wire carries): the executor writes into
  a staging tensor; `finish` hands the staged shards to `engine.update_weights(..., layout="vllm_shard")`, which on
  the CPU build copies them in and has vLLM rebuild each layer's CPU kernel (oneDNN repacking: the live parameters
  cannot be written directly; see `megarl.rollout.vllm_adapter`, "Weight updates"); the engine keeps no reference
  to the staging tensors. The staging holds at most one inference shard of the model (what this rank's engine
  holds anyway).

`finish` then resets the prefix cache, so no KV block computed with old weights is reused.

Mixture-of-experts: the plan writes each routed expert into its own slot of vLLM's stacked `w13_weight` /
`w2_weight` ([E_local, ...]; slot names `param[e]`, `layouts.expert_slot_name`): `target` hands out `stacked[e]`, a
view into the one staged (or live) tensor, and the stacked parameter is complete once all its slots are committed.

Delta mode (`persistent=True`): the destination must still hold the previous sync's values. Staging tensors are
kept between reshards (on the CPU build: one extra inference shard in the training dtype); in-place targets are the
engine's parameters, which keep their values as long as the engine is not put to `sleep(level=2)` between syncs
(level 2 discards weights: use level 1, or `DeltaState.reset()` after it).
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.reshard.layouts import split_expert_slot


def in_place_target(live: Optional[torch.Tensor], shape, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The engine parameter to write into directly, or None when the shard must be staged.

    `live`: the engine's parameter (None: the engine exposes none for this name). It qualifies when it has the
    shard's exact shape and the wire dtype (the executor writes raw received elements, no cast) and is contiguous
    (the executor slices it by offsets along the shard's dims)."""
    if live is None or tuple(live.shape) != tuple(shape) or live.dtype != dtype or not live.is_contiguous():
        return None
    return live


class VllmShardSink:
    """`WeightSink` feeding a rollout engine: in place where the engine allows it, else staged and loaded with
    `update_weights(iterable of (vLLM name, shard), "vllm_shard")` (see the module docstring).

    Counters after each `finish`: `written_in_place` and `tensors_fed` (staged shards loaded through vLLM)."""

    def __init__(self, engine, keep_fed: bool = False, persistent: bool = False) -> None:
        """`keep_fed=True` keeps a copy of the last shards fed in `last_fed` (tests compare them with vLLM's layout);
        `persistent=True` keeps every destination's contents between reshards (delta mode)."""
        self.engine = engine
        self.keep_fed = keep_fed
        self.keeps_targets = persistent
        self.last_fed: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor] = {}
        self._in_place: dict[str, torch.Tensor] = {}
        self._done: list[str] = []
        # vLLM lists a tied lm_head once, under the embedding: shards it does not list are not fed.
        described = engine.param_shards()
        self._dtypes = {s.name: s.dtype for s in described}
        self._shapes = {s.name: tuple(s.shape) for s in described if getattr(s, "shape", None) is not None}
        self._pad_rows = {s.name: s.pad_rows for s in described if getattr(s, "pad_rows", 0)}
        self._known = set(self._dtypes)
        # An engine built with LoRA support names its wrapped linears and embeddings `<module>.base_layer.<param>`;
        # the plan uses the plain vLLM names: translate (the plain name -> the engine's).
        self._engine_name = {n.replace(".base_layer.", "."): n for n in self._known if ".base_layer." in n}
        self._slots_done: dict[str, set[int]] = {}
        self._live: Optional[dict[str, torch.Tensor]] = None
        self.tensors_fed = 0
        self.written_in_place = 0

    def _live_params(self) -> dict[str, torch.Tensor]:
        # Looked up once per reshard: wake_up(("weights",)) re-maps the same addresses, but a rebuilt engine would not.
        if self._live is None:
            writable = getattr(self.engine, "writable_params", None)
            self._live = dict(writable()) if writable is not None else {}
        return self._live

    def target(self, param: str, shape, dtype) -> torch.Tensor:
        param = self._engine_name.get(param, param)
        slot = split_expert_slot(param)
        if slot is not None:
            base, expert = slot
            stacked = self._shapes.get(base)
            if stacked is None:
                raise KeyError(f"the rollout engine has no expert parameter {base!r} (slot {param!r})")
            if tuple(stacked[1:]) != tuple(shape) or not 0 <= expert < stacked[0]:
                raise ValueError(f"expert slot {param!r} of shape {tuple(shape)} does not fit the engine's {base} "
                                 f"of shape {stacked}")
            existing = self._in_place.get(base, self._staged.get(base))  # another slot of it was written already
            if existing is not None and tuple(existing.shape) == tuple(stacked) and existing.dtype == dtype:
                return existing[expert]
            return self.target(base, stacked, dtype)[expert]
        if param not in self._known:
            raise KeyError(f"the rollout engine has no parameter {param!r}; it has e.g. {sorted(self._known)[:3]}")
        live = in_place_target(self._live_params().get(param), shape, dtype)
        if live is not None:
            pad = self._pad_rows.get(param, 0)
            if pad:  # vocab padding rows: no plan writes them; zero, as a staged shard's are (`build_shard`)
                live[-pad:].zero_()
            self._in_place[param] = live
            return live
        old = self._staged.get(param)
        if self.keeps_targets and old is not None and old.shape == tuple(shape) and old.dtype == dtype:
            return old
        t = torch.zeros(shape, dtype=dtype)
        self._staged[param] = t
        return t

    def commit(self, param: str) -> None:
        param = self._engine_name.get(param, param)
        slot = split_expert_slot(param)
        if slot is None:
            self._done.append(param)
            return
        base, expert = slot
        done = self._slots_done.setdefault(base, set())
        done.add(expert)
        if len(done) == self._shapes[base][0]:  # every local expert of the stacked parameter is written
            self._done.append(base)

    def finish(self) -> None:
        missing = self._known - set(self._done)
        if missing:
            raise RuntimeError(f"reshard did not produce {len(missing)} vLLM parameter(s), e.g. {sorted(missing)[:3]}")
        in_place = [name for name in self._done if name in self._in_place]
        staged = [(name, self._staged[name].to(self._dtypes[name])) for name in self._done
                  if name not in self._in_place]
        self.tensors_fed = self.engine.update_weights(iter(staged), layout="vllm_shard") if staged else 0
        if not staged:
            self.engine.reset_prefix_cache()  # update_weights does it otherwise
        self.written_in_place = len(in_place)
        if self.keep_fed:  # targets change at the next reshard: keep copies
            self.last_fed = {n: t.clone() if self.keeps_targets else t for n, t in staged}
            self.last_fed.update({n: self._in_place[n].detach().clone() for n in in_place})
        if not self.keeps_targets:
            self._staged.clear()
        self._in_place.clear()
        self._slots_done.clear()
        self._done.clear()
        self._live = None
