"""The reshard checksum, pure: two integers from the piece's bits in logical element order, checked against a
reference computed here with numpy from the bytes; equal whatever the memory layout (strided view, transposed
storage, non-zero storage offset), different for the corruptions it is meant to catch (a flipped bit, the lowest
mantissa bit included, rows or elements swapped, a run shifted by one row)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.reshard.verify import checksum

DTYPES = [torch.float32, torch.bfloat16]


def reference_checksum(t: torch.Tensor) -> list[int]:
    """The module docstring's (S1, S2), written independently: the tensor's bytes in row-major element order, read
    by numpy as little-endian int16 words v_k; S1 = sum v_k, S2 = sum v_k * ((k mod 65521) + 1), in int64 (the
    sizes here are far from overflow)."""
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    v = np.frombuffer(raw, dtype="<i2").astype(np.int64)
    k = np.arange(v.size, dtype=np.int64)
    return [int(v.sum()), int((v * (k % 65521 + 1)).sum())]


@pytest.mark.parametrize("flush_rows", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_checksum_matches_the_reference_sums(dtype, flush_rows, monkeypatch):
    if flush_rows is not None:  # the int32 accumulators flushed into int64 every 2 rows, not every 2^15
        monkeypatch.setattr("megarl.reshard.verify._FLUSH_ROWS", flush_rows)
    g = torch.Generator().manual_seed(2)
    for shape in [(7,), (64, 96), (300, 500), ()]:  # (300, 500): several 65521-word rows and a tail
        t = torch.randn(shape, generator=g).to(dtype)
        assert checksum(t).tolist() == reference_checksum(t), shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_values_equal_checksums_across_layouts(dtype):
    g = torch.Generator().manual_seed(0)
    megatron = torch.randn(160, 96, generator=g).to(dtype)  # a column run, as o_proj/down_proj pieces are
    piece = megatron.narrow(1, 32, 48)  # strided: row stride 96
    ref = checksum(piece.contiguous())
    vllm = torch.zeros(160, 80, dtype=dtype)
    vllm.narrow(1, 16, 48).copy_(piece)
    transposed = piece.t().contiguous().t()  # same values, column-major storage
    assert transposed.stride() == (1, 160)
    buffer = torch.zeros(160 * 48 + 1000, dtype=dtype)
    offset = buffer[777:777 + 160 * 48].view(160, 48)  # a view at a non-zero storage offset (odd, in elements)
    offset.copy_(piece)
    assert offset.storage_offset() == 777
    for same in (piece, vllm.narrow(1, 16, 48), transposed, offset):
        assert torch.equal(checksum(same), ref)
    assert checksum(piece).dtype == torch.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowest_mantissa_bit_changes_the_checksum(dtype):
    g = torch.Generator().manual_seed(3)
    t = torch.randn(128, 512, generator=g).to(dtype)  # 64k elements: rows far longer than a float32 ulp allows
    flipped = t.clone()
    bits = flipped.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    bits[57, 300] ^= 1  # the lowest mantissa bit of one element
    assert not torch.equal(flipped, t)
    assert not torch.equal(checksum(flipped), checksum(t))
    assert not torch.equal(checksum(flipped.t().contiguous().t()), checksum(t))  # whatever the layout


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
    norm = torch.randn(40, generator=g)  # 1-D
    moved = norm.clone()
    moved[[0, 1]] = moved[[1, 0]]
    assert not torch.equal(checksum(moved), checksum(norm))
    within_row = t.clone()  # elements swapped inside one row
    within_row[5, [2, 9]] = within_row[5, [9, 2]]
    assert not torch.equal(checksum(within_row), ref)


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


def test_local_pieces_are_checked_bit_for_bit():
    """A local op (source and destination in one process) is compared with its source slice bit for bit: identical
    NaNs pass, a flipped lowest mantissa bit or -0.0 for 0.0 is refused naming the piece; a strided destination
    view holding the right values passes."""
    from megarl.models.spec import ModelSpec
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.verify import ReshardVerificationError, check_written

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=2, hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, head_dim=32, ffn_hidden_size=256, vocab_size=300,
                     max_position_embeddings=256)
    plan = plan_reshard(spec, RoleTopology(pp=2), 2, dtype_bytes=4)
    op = next(o for o in plan.ops if o.src == 0 and o.dst == 0)
    source = torch.randn(op.piece.length, 3)
    source[0, 0] = float("nan")
    source[1, 1] = 0.0
    check_written({}, lambda _: source.clone(), rank=0, infer_rank=0, local={op: source})
    check_written({}, lambda _: source.clone().t().contiguous().t(), rank=0, infer_rank=0, local={op: source})
    flipped = source.clone()
    flipped.view(torch.int32)[2, 2] ^= 1  # the lowest mantissa bit
    negative_zero = source.clone()
    negative_zero[1, 1] = -0.0
    for written in (flipped, negative_zero):
        with pytest.raises(ReshardVerificationError) as err:
            check_written({}, lambda _, w=written: w, rank=0, infer_rank=0, local={op: source})
        assert f"vLLM parameter {op.dst_param!r}" in str(err.value) and "1 piece(s) differ" in str(err.value)


def test_checksum_at_the_path_boundary_matches_the_reference():
    """Pieces around one row of weights (65520-65522 words) and around 2^17 words, where the float64 short path
    (at most 2^17) meets the column path (above), give the reference sums: the same integers on both sides."""
    g = torch.Generator().manual_seed(4)
    for words in (65520, 65521, 65522, 131042, 2**17 - 1, 2**17, 2**17 + 1, 3 * 65521 + 7):
        t = torch.randn(words, generator=g).to(torch.bfloat16)  # one 16-bit word per element
        assert checksum(t).tolist() == reference_checksum(t), words
        assert checksum(t.view(-1, 1)[::1]).tolist() == reference_checksum(t), words


@pytest.mark.parametrize("words", [2**17, 2**17 + 1])
def test_checksum_is_exact_at_the_largest_sums(words):
    """Every word at its extreme (-2^15: the largest |S1| and |S2| a piece of this length can have) on both sides of
    the float64 path's bound: the sums still equal numpy's int64 reference to the last unit (a path in a float type
    too narrow for them, float32, rounds them)."""
    t = torch.full((words,), -(2**15), dtype=torch.int16).view(torch.bfloat16)
    assert checksum(t).tolist() == reference_checksum(t)
    t = torch.full((words,), 2**15 - 1, dtype=torch.int16).view(torch.bfloat16)
    assert checksum(t).tolist() == reference_checksum(t)
