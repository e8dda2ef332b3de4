"""The batch protocol: named tensors that share the batch dimension, plus non-tensor metadata.

Every role method takes and returns a `Batch`. Sequence layout (one row per sample, right-padded); a single-turn
row, then a multi-turn one (`megarl.data.trajectory`)::

    position t:        0 .. p-1            p .. n-1                                    n .. S-1
    input_ids [B, S]   prompt tokens       response tokens                             pad (any id)
    attention_mask     1                   1                                           0  (a prefix of ones)
    loss_mask          0                   1                                           0
    (multi-turn)       0                   1 1 1 (sampled) 0 0 0 (tool) 1 1 (sampled)  0

``loss_mask`` marks the tokens the policy sampled: the ones that are trained and scored. It need not be one
contiguous span: tokens the policy did not sample (tool / environment output between turns) are 0 and only
condition what follows. Every loss, advantage, KL, entropy and metric reads this mask, never a span.

Per-token quantities are **token-aligned** [B, S] float32: the value at position t belongs to the token *at*
position t. A token's log-prob is scored by the logits at t-1 (``log_probs[b, t] = log p(input_ids[b, t] |
input_ids[b, :t])``), a token's value is the critic's output at t-1 (the state before the token is emitted),
and both are 0 wherever ``loss_mask`` is 0 (so ``loss_mask[:, 0]`` must be 0: a sampled token needs at least
one prompt token before it). The keys used by the roles:

    input_ids       [B, S] int64     prompt + response tokens, right-padded
    attention_mask  [B, S] int64/bool  1 on real tokens (prompt, sampled or context)
    loss_mask       [B, S] int64/bool  1 on the tokens the policy sampled (trained / scored); 0 on the prompt,
                                     on context tokens and on padding
    response_mask   the legacy name of ``loss_mask``, with the same meaning: a batch carries one or the other
                    (`Batch.with_loss_mask` puts it under ``loss_mask``; the roles accept either). The single-turn
                    SFT batches and `megarl.trainer.samples.samples_to_batch` still use it.
    log_probs, old_log_probs, ref_log_probs, entropy, advantages, values, old_values, returns
                    [B, S] float32   token-aligned, 0 where loss_mask is 0
    rollout_log_probs [B, S] float32  the rollout engine's log-probs of the sampled tokens, 0 where loss_mask is 0
    policy_version  [B, S] int64     weights version that sampled each token, -1 where loss_mask is 0 (concatenate
                                     with ``pad_values={"policy_version": -1}`` to keep padding at -1)
    group_ids       [B] int64        GRPO/RLOO group of each sample (equal ids: the same prompt)
    scores          [B] float32      reward model: scalar read at the last real token (attention_mask)

The algorithms in `megarl.algorithms` take [batch, len] tensors with a mask (their parameter is still named
``response_mask``: it is the loss mask); token-aligned [B, S] tensors with ``loss_mask`` satisfy them directly
(masked positions are ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

# meta key naming the worker method whose declared reads selected this batch (`megarl.controller.dispatch`): a
# missing key is then reported as an undeclared read of that method.
READS_META = "dispatch_reads_of"


@dataclasses.dataclass
class Batch:
    """Tensors sharing dim 0 (the sample dimension) and a free-form `meta` dict (not split, copied along)."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch tensors must share the batch dimension, got sizes {sizes}")

    # -------------------------------------------------------------------------------------------- access
    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise KeyError(f"batch has no tensor {key!r}; it has {sorted(self.tensors)}{self._reads_hint([key])}") \
                from None

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def require(self, *keys: str) -> None:
        """Raise naming every missing key (and what the batch has)."""
        missing = [k for k in keys if k not in self.tensors]
        if missing:
            raise KeyError(f"batch is missing {missing}; it has {sorted(self.tensors)}{self._reads_hint(missing)}")

    def _reads_hint(self, keys: list[str]) -> str:
        method = self.meta.get(READS_META)
        if method is None:
            return ""
        return (f" (the controller sent only the keys {method} declares it reads: add {keys} to its "
                "@dispatch(reads=...) or optional_reads=...)")

    def with_loss_mask(self) -> "Batch":
        """This batch with its mask under ``loss_mask``: itself when it has ``loss_mask``; the legacy
        ``response_mask`` renamed otherwise. Raises KeyError when it has neither, ValueError when it has both and
        they differ."""
        if "response_mask" not in self.tensors:
            self.require("loss_mask")
            return self
        legacy = self.tensors["response_mask"]
        if "loss_mask" in self.tensors:
            if not torch.equal(self.tensors["loss_mask"].long(), legacy.long()):
                raise ValueError("batch has both loss_mask and its legacy alias response_mask, and they differ")
            return self
        tensors = {k: v for k, v in self.tensors.items() if k != "response_mask"}
        tensors["loss_mask"] = legacy
        return Batch(tensors, dict(self.meta))

    # -------------------------------------------------------------------------------------------- derive
    def select(self, keys: Iterable[str]) -> "Batch":
        keys = list(keys)
        self.require(*keys)
        return Batch({k: self.tensors[k] for k in keys}, dict(self.meta))

    def update(self, other: "Batch | Mapping[str, torch.Tensor]") -> "Batch":
        """A new batch with `other`'s tensors added (replacing same-named ones)."""
        extra = other.tensors if isinstance(other, Batch) else dict(other)
        return Batch({**self.tensors, **extra}, dict(self.meta))

    def index(self, idx: torch.Tensor | Sequence[int]) -> "Batch":
        """Rows `idx` (a permutation, subset or slice of sample indices), in that order."""
        if not isinstance(idx, torch.Tensor):
            idx = torch.as_tensor(list(idx), dtype=torch.long)
        return Batch({k: v[idx.to(v.device)] for k, v in self.tensors.items()}, dict(self.meta))

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch({k: v[start:stop] for k, v in self.tensors.items()}, dict(self.meta))

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of `size` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def chunk_by_dp(self, dp_rank: int, dp: int) -> "Batch":
        """Data-parallel rank `dp_rank`'s contiguous share of `dp` equal shares."""
        n = len(self)
        if n % dp != 0:
            raise ValueError(f"batch of {n} samples does not split evenly over dp={dp} data-parallel ranks")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} outside 0..{dp - 1}")
        per = n // dp
        return self.slice(dp_rank * per, (dp_rank + 1) * per)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.meta))

    def trim(self, length: int) -> "Batch":
        """Keep the first `length` positions of every tensor with a sequence dimension ([B, S, ...])."""
        seq = self.seq_len
        return Batch(
            {k: (v[:, :length] if v.dim() >= 2 and v.shape[1] == seq else v) for k, v in self.tensors.items()},
            dict(self.meta),
        )

    @property
    def seq_len(self) -> int:
        return self["input_ids"].shape[1]

    def lengths(self) -> torch.Tensor:
        """[B] int64: real tokens per sample (from `attention_mask`)."""
        return self["attention_mask"].long().sum(-1)

    @staticmethod
    def concat(batches: Sequence["Batch"], pad_values: Optional[Mapping[str, float]] = None) -> "Batch":
        """Concatenate along the batch dimension; [B, S] tensors of different lengths are right-padded with 0
        (or `pad_values[key]`) to the longest. `meta` is taken from the first batch."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        keys = batches[0].keys()
        for b in batches[1:]:
            if set(b.keys()) != set(keys):
                raise ValueError(f"cannot concat batches with different keys: {sorted(keys)} vs {sorted(b.keys())}")
        out = {}
        for k in keys:
            parts = [b[k] for b in batches]
            if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
                width = max(p.shape[1] for p in parts)
                fill = (pad_values or {}).get(k, 0)
                parts = [
                    torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1]), value=fill)
                    for p in parts
                ]
            out[k] = torch.cat(parts, dim=0)
        return Batch(out, dict(batches[0].meta))
