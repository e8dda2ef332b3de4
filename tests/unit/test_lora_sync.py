"""The engine-free parts of the LoRA sync (`megarl.reshard.lora_sync`, `megarl.rollout.vllm_lora.check_adapter`):
merged sources, the adapter transport check, the adapter validation and the bytes model. The paths through a real
vLLM engine are `tests/distributed/test_lora_sync_vllm.py`."""

from __future__ import annotations

import pytest
import torch

from megarl.reshard.lora_sync import adapter_checksums, merge_lora_sources, sync_adapter, sync_bytes
from megarl.reshard.verify import ReshardVerificationError
from megarl.rollout.vllm_lora import check_adapter

P = "base_model.model.model.layers.0.self_attn.q_proj"


def _adapter(r=2, out=3, inp=4):
    g = torch.Generator().manual_seed(0)
    return {f"{P}.lora_A.weight": torch.randn(r, inp, generator=g),
            f"{P}.lora_B.weight": torch.randn(out, r, generator=g)}


def test_merged_sources_add_the_delta_in_float32_and_round_once():
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16)
    norm = torch.ones(2)
    # 2^-8 + 2^-20: 1 + it lies just above the midpoint of bf16's step at 1.0 (2^-7), so one rounding gives
    # 1 + 2^-7; casting the delta to bf16 first (2^-8) and adding in bf16 would tie and round to even: 1.0
    delta = torch.tensor([[2.0**-8 + 2.0**-20, 0.5], [-1.0, 0.0]])
    merged = merge_lora_sources({"fc.weight": base, "norm.weight": norm}, {"fc.weight": delta})
    assert merged["norm.weight"] is norm  # untouched sources are passed through, not copied
    assert merged["fc.weight"].dtype == torch.bfloat16
    assert merged["fc.weight"].float().tolist() == [[1.0 + 2.0**-7, 2.5], [2.0, 4.0]]
    assert base.float().tolist() == [[1.0, 2.0], [3.0, 4.0]]  # the actor's weights are not modified


def test_merged_sources_refuse_a_delta_without_its_base_or_of_another_shape():
    with pytest.raises(KeyError, match="linear_qkv.weight.*no base weight"):
        merge_lora_sources({"fc.weight": torch.zeros(2, 2)}, {"linear_qkv.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*\(2, 2\)"):
        merge_lora_sources({"fc.weight": torch.zeros(2, 2)}, {"fc.weight": torch.zeros(2, 3)})


def test_adapter_sync_refuses_tensors_that_arrived_changed_before_the_engine_sees_them():
    sent = _adapter()
    sums = adapter_checksums(sent)
    received = {n: t.clone() for n, t in sent.items()}
    bits = received[f"{P}.lora_B.weight"].view(torch.int32)
    bits[1, 1] ^= 1  # the lowest mantissa bit of one element
    with pytest.raises(ReshardVerificationError, match="lora_B"):
        sync_adapter(None, received, {"r": 2, "lora_alpha": 4}, sent_checksums=sums)
    with pytest.raises(ReshardVerificationError, match="sent or received only once"):
        sync_adapter(None, {f"{P}.lora_A.weight": sent[f"{P}.lora_A.weight"]}, {"r": 2, "lora_alpha": 4},
                     sent_checksums=sums)


def test_check_adapter_returns_rank_and_scaling_and_names_what_is_wrong():
    assert check_adapter(_adapter(), {"r": 2, "lora_alpha": 8}) == (2, 4.0)
    with pytest.raises(ValueError, match="use_rslora"):
        check_adapter(_adapter(), {"r": 2, "lora_alpha": 8, "use_rslora": True})
    with pytest.raises(ValueError, match=r"only one of lora_A / lora_B"):
        check_adapter({f"{P}.lora_A.weight": torch.zeros(2, 4)}, {"r": 2, "lora_alpha": 8})
    with pytest.raises(ValueError, match=r"shape \(2, 4\).*rank 3"):
        check_adapter(_adapter(), {"r": 3, "lora_alpha": 8})
    with pytest.raises(ValueError, match="not a PEFT LoRA weight"):
        check_adapter({"model.layers.0.q_proj.weight": torch.zeros(2, 2)}, {"r": 2, "lora_alpha": 8})


def test_sync_bytes_by_hand():
    # two linears 4->6 and 6->4, rank 2, bf16, 2 replicas of TP 2
    got = sync_bytes([(4, 6), (6, 4)], rank=2, elem_bytes=2, infer_tp=2, replicas=2)
    per_rank_adapter = (2 * 10 + 2 * 10) * 2  # r (in + out) elements each
    merged_once = (24 + 24) * 2  # in x out elements each
    assert got == {"adapter": per_rank_adapter * 4, "merged": merged_once * 2,
                   "adapter_per_rank": per_rank_adapter, "merged_per_rank": merged_once // 2}
