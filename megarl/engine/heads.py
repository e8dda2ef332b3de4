"""Scalar heads for the critic (per-token value) and the reward model (per-sequence score).

`ScalarHead` replaces `GPTModel.output_layer` on the last pipeline stage: hidden [seq, batch, hidden] ->
[seq, batch, 1], a bias-free linear hidden -> 1. It is *replicated* across tensor-parallel ranks (not split):
its input (the final-norm output) is the full hidden state on every TP rank (no sequence parallelism), so every
TP rank computes the same output, the same loss and the same gradient for the head; the gradient flowing back
into the decoder is complete on each rank (unlike a vocab-parallel output layer, whose partial input gradients
megatron's column-parallel linear all-reduces). Megatron counts a parameter without `tensor_model_parallel` once
in the grad norm (TP rank 0 only), as it does for norm weights, and DDP reduces it over data-parallel ranks like
any other parameter.

Checkpoint names: the head's parameter is `output_layer.score.weight` [1, hidden] inside the Megatron model
(megatron-core's distributed checkpoint stores it under that key); its HuggingFace name is `score.weight`, the
name transformers' `*ForTokenClassification` / `*ForSequenceClassification` models (num_labels=1) use.
"""

from __future__ import annotations

import math

import torch

HF_HEAD_NAME = "score.weight"
MEGATRON_HEAD_NAME = "output_layer.score.weight"


class ScalarHead(torch.nn.Module):
    """hidden [s, b, h] -> ([s, b, 1], None), called like megatron's output layer (extra kwargs ignored).

    `sp_group` (sequence parallelism, MoE at tp > 1): the hidden states arrive as this TP rank's slice [s/tp, b, h];
    they are gathered over it first, so every TP rank returns the whole sequence's values (as megatron's vocabulary
    output layer does). Every TP rank then computes the same loss on the whole sequence, so the gather's backward
    keeps this rank's slice of the gradient (`tensor_parallel_output_grad=False`), not their sum."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, seed: int, sp_group=None) -> None:
        super().__init__()
        self.sp_group = sp_group
        self.score = torch.nn.Linear(hidden_size, 1, bias=False, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # identical on every TP rank and layout at the same seed
            w = torch.randn(1, hidden_size, generator=g) / math.sqrt(hidden_size)
            self.score.weight.copy_(w.to(dtype))
        # megatron's optimizer/DDP look for these attributes; a replicated (not TP-split) parameter
        self.score.weight.tensor_model_parallel = False
        self.score.weight.partition_dim = -1
        self.score.weight.partition_stride = 1
        self.sequence_parallel = False

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sp_group is not None and self.sp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.sp_group)
        return self.score(hidden_states), None


def attach_scalar_head(model, hidden_size: int, dtype: torch.dtype, seed: int, sp_group=None) -> None:
    """Replace `model.output_layer` (a last-stage GPTModel) with a `ScalarHead`, in place.

    megatron-core 0.16.1's `LanguageModule.sharded_state_dict` assumes a vocabulary output layer (it flags
    `output_layer.weight` for vocab-padding shape mismatch and fails when the key is absent); the model's class is
    swapped for a subclass whose `sharded_state_dict` skips that step. Scalar-head models are never tied, so
    nothing else in it applies.
    """
    model.output_layer = ScalarHead(hidden_size, dtype, seed, sp_group)
    model.__class__ = _scalar_head_class(type(model))


_CLASSES: dict[type, type] = {}


def _scalar_head_class(base: type) -> type:
    if base not in _CLASSES:
        from megatron.core.models.common.language_module.language_module import LanguageModule

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            metadata = ensure_metadata_has_dp_cp_group(metadata)
            sd = super(LanguageModule, self).sharded_state_dict(prefix, sharded_offsets, metadata)
            sd.pop(f"{prefix}output_layer._extra_state", None)
            return sd

        _CLASSES[base] = type(f"{base.__name__}WithScalarHead", (base,), {"sharded_state_dict": sharded_state_dict})
    return _CLASSES[base]
