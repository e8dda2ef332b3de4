"""The reshard checksum, pure: equal for equal values whatever the strides, different for the corruptions it is
meant to catch (a flipped exponent bit, rows swapped, a run shifted by one row)."""

from __future__ import annotations

import pytest
import torch

from megarl.reshard.verify import checksum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_values_equal_checksums_across_strides(dtype):
    g = torch.Generator().manual_seed(0)
    megatron = torch.randn(64, 96, generator=g).to(dtype)  # a column run, as o_proj/down_proj pieces are
    piece = megatron.narrow(1, 32, 48)
    vllm = torch.zeros(64, 80, dtype=dtype)
    vllm.narrow(1, 16, 48).copy_(piece)
    assert torch.equal(checksum(piece), checksum(vllm.narrow(1, 16, 48)))
    assert torch.equal(checksum(piece), checksum(piece.contiguous()))


def test_corruptions_change_the_checksum():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(32, 40, generator=g)
    ref = checksum(t)
    flipped = t.clone()
    flipped.view(torch.uint8)[3] ^= 0x40  # an exponent bit of element 0
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    shifted = torch.cat([t[1:], t[:1]])
    for bad in (flipped, swapped, shifted):
        assert not torch.equal(checksum(bad), ref)
    norm = torch.randn(40, generator=g)  # 1-D: the elements are the rows
    moved = norm.clone()
    moved[[0, 1]] = moved[[1, 0]]
    assert not torch.equal(checksum(moved), checksum(norm))


def test_check_written_names_the_piece_and_accepts_identical_nans():
    from megarl.models.spec import ModelSpec
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.verify import ReshardVerificationError, check_written

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=2, hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, head_dim=32, ffn_hidden_size=256, vocab_size=300,
                     max_position_embeddings=256)
    plan = plan_reshard(spec, RoleTopology(pp=2), 2, dtype_bytes=4)
    op = next(o for o in plan.ops if o.src == 0 and o.dst == 1)
    data = torch.full((op.piece.length, 3), float("nan"))
    check_written({op: checksum(data)}, lambda _: data.clone(), rank=1, infer_rank=1)  # NaN == NaN bitwise
    with pytest.raises(ReshardVerificationError) as err:
        check_written({op: checksum(data)}, lambda _: torch.zeros_like(data), rank=1, infer_rank=1)
    assert f"vLLM parameter {op.dst_param!r}" in str(err.value) and "from source rank 0" in str(err.value)
    assert "inference TP rank 1 (global rank 1)" in str(err.value)
