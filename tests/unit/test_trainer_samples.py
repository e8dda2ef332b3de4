"""Controller-side pieces of the RL loop: samples -> Batch, prompt chunks per rollout replica."""

import pytest

from megarl.rollout.engine import RolloutSample
from megarl.trainer.samples import chunk_bounds, samples_to_batch


def _s(prompt_index, prompt, response, lps):
    return RolloutSample(prompt_index=prompt_index, sample_index=0, prompt_ids=prompt, response_ids=response,
                         response_log_probs=lps, finish_reason="stop")


def test_samples_to_batch_layout():
    b = samples_to_batch([_s(0, [1, 5, 6], [7, 8], [-0.5, -0.25]), _s(1, [1, 9], [4], [-1.0])], pad_id=0)
    t = b.tensors
    assert t["input_ids"].tolist() == [[1, 5, 6, 7, 8], [1, 9, 4, 0, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert t["response_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert t["rollout_log_probs"].tolist() == [[0, 0, 0, -0.5, -0.25], [0, 0, -1.0, 0, 0]]
    assert t["group_ids"].tolist() == [0, 1]


def test_samples_to_batch_lays_out_rollout_routing():
    import numpy as np
    import torch

    # sample 0: 3 prompt + 2 response tokens -> 4 routed positions; sample 1: 2 + 1 -> 2; 1 MoE layer, top-2
    a = np.array([[[0, 1]], [[2, 3]], [[1, 2]], [[3, 0]]], dtype=np.int16)
    b = np.array([[[3, 2]], [[0, 2]]], dtype=np.int16)
    s0 = _s(0, [1, 5, 6], [7, 8], [-0.5, -0.25])
    s1 = _s(1, [1, 9], [4], [-1.0])
    batch = samples_to_batch([RolloutSample(**{**s0.__dict__, "routed_experts": a}),
                              RolloutSample(**{**s1.__dict__, "routed_experts": b})])
    assert batch["rollout_routing_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    experts = batch["rollout_routed_experts"]
    assert experts.shape == (2, 5, 1, 2) and experts.dtype == torch.long
    assert experts[0, :, 0].tolist() == [[0, 1], [2, 3], [1, 2], [3, 0], [0, 0]]
    assert experts[1, :, 0].tolist() == [[3, 2], [0, 2], [0, 0], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="1 of 2 samples carry no routed experts"):
        samples_to_batch([RolloutSample(**{**s0.__dict__, "routed_experts": a}), s1])
    with pytest.raises(ValueError, match=r"sample 0: routed_experts has shape \(3, 1, 2\), expected \(4, 1, 2\)"):
        samples_to_batch([RolloutSample(**{**s0.__dict__, "routed_experts": a[:3]})])


def test_empty_step_and_empty_prompt_are_errors():
    with pytest.raises(ValueError, match="no rollout samples to train on"):
        samples_to_batch([])
    with pytest.raises(ValueError, match="sample 0 has an empty prompt"):
        samples_to_batch([_s(0, [], [3], [-1.0])])


@pytest.mark.parametrize("n,parts", [(8, 2), (7, 2), (5, 4), (3, 4), (0, 2)])
def test_chunks_cover_every_prompt_once_in_order(n, parts):
    bounds = [chunk_bounds(n, parts, k) for k in range(parts)]
    covered = [i for lo, hi in bounds for i in range(lo, hi)]
    assert covered == list(range(n))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_chunk_index_checked():
    with pytest.raises(ValueError, match="chunk 2 is outside 0..1"):
        chunk_bounds(4, 2, 2)
