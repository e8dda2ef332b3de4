"""Trajectories (`megarl.data.trajectory`): a hand-built multi-turn trajectory laid out as batch tensors checked by
hand, the single-turn conversion against the layout `samples_to_batch` has always produced, and the loss-mask alias."""

from __future__ import annotations

import random

import pytest
import torch

from megarl.data.batch import Batch
from megarl.data.trajectory import CONTEXT_VERSION, Trajectory, TrajectoryBuilder, trajectories_to_batch
from megarl.rollout.engine import RolloutSample
from megarl.trainer.samples import samples_to_batch


def multi_turn() -> Trajectory:
    """prompt [1, 2, 3] | sampled [7, 8] (weights v4) | tool output [50, 51, 52] | sampled [9, 10] (weights v5)."""
    return (TrajectoryBuilder([1, 2, 3], uid="a", group_uid="q0")
            .sampled([7, 8], [-0.5, -0.25], policy_version=4)
            .context([50, 51, 52])
            .sampled([9, 10], [-1.0, -0.125], policy_version=5)
            .build("stop"))


def test_multi_turn_trajectory_fields():
    t = multi_turn()
    assert t.token_ids == [1, 2, 3, 7, 8, 50, 51, 52, 9, 10] and t.prompt_len == 3 and len(t) == 10
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert t.log_probs == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0, -0.125]
    assert t.policy_version == [-1, -1, -1, 4, 4, -1, -1, -1, 5, 5]
    assert t.prompt_ids == [1, 2, 3] and t.response_ids == [7, 8, 50, 51, 52, 9, 10] and t.num_sampled == 4


def test_multi_segment_trajectories_to_batch_by_hand():
    single = Trajectory.from_rollout_sample(
        RolloutSample(prompt_index=7, sample_index=0, prompt_ids=[1, 4], response_ids=[6], response_log_probs=[-2.0],
                      finish_reason="length"), policy_version=5)
    other = TrajectoryBuilder([1, 2, 3], uid="c", group_uid="q0").sampled([11], [-0.75], policy_version=5).build("stop")
    assert (single.uid, single.group_uid, single.finish_reason) == ("7/0", "7", "length")
    b = trajectories_to_batch([multi_turn(), single, other], pad_id=0).tensors
    assert b["input_ids"].tolist() == [[1, 2, 3, 7, 8, 50, 51, 52, 9, 10],
                                       [1, 4, 6, 0, 0, 0, 0, 0, 0, 0],
                                       [1, 2, 3, 11, 0, 0, 0, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1] * 10, [1, 1, 1] + [0] * 7, [1, 1, 1, 1] + [0] * 6]
    assert b["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1, 1],
                                       [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
                                       [0, 0, 0, 1, 0, 0, 0, 0, 0, 0]]
    assert b["rollout_log_probs"].tolist() == [[0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0, -0.125],
                                               [0, 0, -2.0, 0, 0, 0, 0, 0, 0, 0],
                                               [0, 0, 0, -0.75, 0, 0, 0, 0, 0, 0]]
    assert b["policy_version"].tolist() == [[-1, -1, -1, 4, 4, -1, -1, -1, 5, 5],
                                            [-1, -1, 5, -1, -1, -1, -1, -1, -1, -1],
                                            [-1, -1, -1, 5, -1, -1, -1, -1, -1, -1]]
    assert b["group_ids"].tolist() == [0, 1, 0]  # "q0", "7", "q0": numbered by first appearance
    assert b["loss_mask"].dtype == b["policy_version"].dtype == b["input_ids"].dtype == torch.long
    assert b["rollout_log_probs"].dtype == torch.float32
    assert "response_mask" not in b  # one name per batch: loss_mask


def test_trajectory_refuses_inconsistent_annotations():
    ok = dict(token_ids=[1, 2, 3], prompt_len=1, loss_mask=[0, 1, 0], log_probs=[0.0, -1.0, 0.0],
              policy_version=[-1, 0, -1], uid="u", group_uid="g", finish_reason="stop")
    Trajectory(**ok)
    bad = [({"loss_mask": [0, 1]}, "every per-token list"),
           ({"prompt_len": 0}, "prompt_len=0 outside 1..3"),
           ({"loss_mask": [1, 1, 0]}, "loss_mask is 1 inside the prompt"),
           ({"loss_mask": [0, 2, 0]}, "must hold 0/1"),
           ({"log_probs": [0.0, -1.0, -0.5]}, "context token 2"),
           ({"policy_version": [-1, 0, 0]}, "context token 2"),
           ({"policy_version": [-1, -1, -1]}, "sampled token 1 has policy_version -1")]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            Trajectory(**{**ok, **change})
    with pytest.raises(ValueError, match="no trajectories to train on"):
        trajectories_to_batch([])


def _legacy_samples_to_batch(samples, pad_id):
    """The single-turn layout as `samples_to_batch` built it before trajectories (commit 451d930), for the
    bit-identity check below."""
    S = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    response_mask = torch.zeros((B, S), dtype=torch.long)
    rollout_log_probs = torch.zeros((B, S), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[i, : p + r] = 1
        response_mask[i, p : p + r] = 1
        if r:
            rollout_log_probs[i, p : p + r] = torch.tensor(s.response_log_probs, dtype=torch.float32)
    group_ids = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
            "rollout_log_probs": rollout_log_probs, "group_ids": group_ids}


@pytest.mark.parametrize("seed", range(5))
def test_single_turn_trajectories_reproduce_the_legacy_layout_bit_for_bit(seed):
    rng = random.Random(seed)
    samples = []
    for p in range(4):  # prompts 0..3, 2 samples each, as `generate` orders them
        prompt = [rng.randrange(1, 100) for _ in range(rng.randrange(1, 6))]
        for k in range(2):
            n = rng.randrange(0, 7)
            samples.append(RolloutSample(p, k, prompt, [rng.randrange(1, 100) for _ in range(n)],
                                         [rng.uniform(-5, 0) for _ in range(n)], rng.choice(["stop", "length"])))
    want = _legacy_samples_to_batch(samples, pad_id=3)
    got = trajectories_to_batch([Trajectory.from_rollout_sample(s, policy_version=2) for s in samples], 3).tensors
    legacy = samples_to_batch(samples, pad_id=3, policy_version=2).tensors
    for key, value in want.items():
        new_key = "loss_mask" if key == "response_mask" else key
        assert torch.equal(got[new_key], value) and got[new_key].dtype == value.dtype, key
        assert torch.equal(legacy[key], value) and legacy[key].dtype == value.dtype, key
    versions = torch.where(want["response_mask"].bool(), 2, CONTEXT_VERSION)
    assert torch.equal(got["policy_version"], versions)


def test_with_loss_mask_accepts_the_legacy_name_once():
    m = torch.tensor([[0, 1, 1]])
    legacy = Batch({"input_ids": torch.zeros(1, 3), "response_mask": m})
    b = legacy.with_loss_mask()
    assert torch.equal(b["loss_mask"], m) and "response_mask" not in b
    assert b.with_loss_mask() is b
    both = legacy.update({"loss_mask": m.clone()})
    assert both.with_loss_mask() is both
    with pytest.raises(ValueError, match="they differ"):
        legacy.update({"loss_mask": torch.tensor([[0, 1, 0]])}).with_loss_mask()
    with pytest.raises(KeyError, match="loss_mask"):
        Batch({"input_ids": torch.zeros(1, 3)}).with_loss_mask()
