"""engine/offload.stash reuses its host buffers across offloads (issue 15 item 12), contents restored exactly."""

import torch

from megarl.engine.offload import restore, stash


def test_second_stash_reuses_the_host_buffers_and_restores_bit_for_bit():
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)
    views = [a[:4], a[2:], b]  # two views of one storage: stashed once
    pool: list[torch.Tensor] = []
    pairs = stash(views, pool)
    assert len(pairs) == 2 and len(pool) == 2 and a.untyped_storage().nbytes() == 0
    first = [h.data_ptr() for h in pool]
    restore(pairs)
    assert torch.equal(a, torch.arange(6, dtype=torch.float32)) and torch.equal(b, torch.ones(3, dtype=torch.bfloat16))
    a.mul_(2)
    pairs = stash(views, pool)
    assert [h.data_ptr() for _, h in pairs] == first  # same host memory, no new allocation
    restore(pairs)
    assert torch.equal(a, 2 * torch.arange(6, dtype=torch.float32))


def test_a_buffer_of_another_size_is_replaced_not_reused():
    pool = [torch.empty(2, dtype=torch.float32)]
    t = torch.arange(5, dtype=torch.float32)
    pairs = stash([t], pool)
    assert pool[0].numel() == 5 and pairs[0][1] is pool[0]
    restore(pairs)
    assert torch.equal(t, torch.arange(5, dtype=torch.float32))
