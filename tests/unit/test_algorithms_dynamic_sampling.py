"""DAPO dynamic sampling (`megarl.algorithms.dynamic_sampling`): which groups are informative, which a step trains
on after several rounds, and the config's refusals. Expected values are worked out by hand from the rule."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megarl.algorithms.dynamic_sampling import enough_groups, informative_groups, select_groups
from megarl.rollout.engine import RolloutSample
from megarl.trainer.producer import BatchProducer, GenerationRound
from tests.unit.test_config import base, error, load


def test_informative_groups_from_hand_written_scores():
    # 4 prompts x 3 samples, rows in any order; prompt 2 was dropped before generation (no samples)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.25, 1.0, 0.25, 0.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 3, 3, 3, 4, 4, 4])
    assert informative_groups(scores, groups, 5) == [True, False, False, True, False]


def test_a_single_sample_group_and_a_tiny_difference():
    scores = torch.tensor([1.0, 0.3, 0.3 + 1e-6])
    groups = torch.tensor([0, 1, 1])
    assert informative_groups(scores, groups, 2) == [False, True]  # one sample: no baseline; any difference counts


def test_selection_takes_informative_groups_in_order_and_counts_the_rest():
    # target 4: round 0 gives 2 informative (prompts 1, 3), round 1 gives 3 (prompts 0, 2, 3): one surplus
    rounds = [[False, True, False, True], [True, False, True, True]]
    assert not enough_groups(rounds[:1], 4) and enough_groups(rounds, 4)
    sel = select_groups(rounds, 4)
    assert sel.selected == [(0, 1), (0, 3), (1, 0), (1, 2)]
    assert (sel.filled, sel.dropped, sel.surplus) == (0, 3, 1)


def test_selection_fills_with_all_equal_groups_when_the_rounds_run_out():
    # target 4, only 1 informative group in 2 rounds; prompt 1 of round 0 was dropped (None): never chosen
    rounds = [[False, None, False, False], [False, True, False, False]]
    sel = select_groups(rounds, 4)
    assert sel.selected == [(1, 1), (0, 0), (0, 2), (0, 3)]
    assert (sel.filled, sel.dropped, sel.surplus) == (3, 3, 0)


def test_selection_with_every_group_informative_is_the_first_round():
    sel = select_groups([[True, True, True]], 3)
    assert sel.selected == [(0, 0), (0, 1), (0, 2)] and (sel.filled, sel.dropped, sel.surplus) == (0, 0, 0)


def test_config_default_off_and_refusals(tmp_path):
    cfg = load(tmp_path, base(), ["algorithm.dynamic_sampling.enabled=true", "algorithm.dynamic_sampling.max_rounds=4"])
    assert cfg.algorithm.dynamic_sampling.max_rounds == 4
    assert not load(tmp_path, base()).algorithm.dynamic_sampling.enabled
    assert error(tmp_path, base(), ["algorithm.dynamic_sampling.max_rounds=0"]).startswith(
        "algorithm.dynamic_sampling.max_rounds")
    with_rm = base()
    with_rm["reward_model"] = {"enabled": True, "model": base()["model"]}
    load(tmp_path, with_rm)  # valid without dynamic sampling
    assert error(tmp_path, with_rm, ["algorithm.dynamic_sampling.enabled=true"]) == (
        "algorithm.dynamic_sampling.enabled: groups are filtered on the rule reward before any learned reward is "
        "computed; not supported with reward_model.enabled=true")
    on = ["algorithm.dynamic_sampling.enabled=true"]
    assert error(tmp_path, base(), on + ["algorithm.name=reinforce_plus_plus"]) == (
        "algorithm.dynamic_sampling.enabled: all-equal groups carry no signal only under a group baseline (grpo, rloo, "
        "reinforce_plus_plus_baseline); the advantage estimator is reinforce_plus_plus")
    assert error(tmp_path, base(), ["algorithm.dynamic_sampling.enabled=true", "rollout.samples_per_prompt=1",
                                    "actor.micro_batch_samples=1"]) == (
        "algorithm.dynamic_sampling.enabled: needs groups of at least 2 samples (rollout.samples_per_prompt=1: every "
        "group would be dropped)")


class _Rounds:
    """`BatchProducer.dynamic_sampling` over hand-written rounds: `_round` returns the next prepared round (4
    prompts x 2 samples each; the scores are chosen so which groups are all-equal is known)."""

    dynamic_sampling = BatchProducer.dynamic_sampling
    overlong_penalty = BatchProducer.overlong_penalty

    def __init__(self, round_scores, max_rounds, dropped=()):
        self.cfg = SimpleNamespace(data=SimpleNamespace(prompts_per_step=4), rollout=SimpleNamespace(max_new_tokens=8),
                                   algorithm=SimpleNamespace(dynamic_sampling=SimpleNamespace(max_rounds=max_rounds),
                                                             overlong=SimpleNamespace(soft_cache_tokens=None)))
        self.prepared = [self._prepared(k, sc, dropped if k == 0 else ()) for k, sc in enumerate(round_scores)]
        self.calls = []

    @staticmethod
    def _prepared(k, scores, dropped):
        records = [f"r{k}p{p}" for p in range(len(scores))]
        samples, flat = [], []
        for p, pair in enumerate(scores):
            if p in dropped:
                continue
            for i, sc in enumerate(pair):
                samples.append(RolloutSample(prompt_index=p, sample_index=i, prompt_ids=[k, p], response_ids=[i],
                                             response_log_probs=[0.0], finish_reason="stop"))
                flat.append(sc)
        metrics = {"reward/errors": 1.0 if k == 1 else 0.0, "reward/timeouts": 0.0, "reward/error_frac": 0.0}
        return GenerationRound(records, samples, list(dropped), torch.tensor(flat), metrics, [])

    def _round(self, index, k, client, version, t):
        self.calls.append(k)
        return self.prepared[k]


def _run(rounds):
    metrics = {}
    samples, dropped, scores, reward, records = rounds.dynamic_sampling(7, None, 6, {}, rounds.prepared[0], metrics)
    groups = [(s.prompt_ids[0], s.prompt_ids[1]) for s in samples[::2]]  # (round, prompt) of each selected group
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2, 3, 3]  # renumbered in training order
    # records[i] is the record of the samples renumbered i (the teachers route by it): round k, prompt p's record
    assert records == [f"r{k}p{p}" for k, p in groups]
    return groups, scores.tolist(), dropped, reward, metrics


def test_trainer_refills_from_later_rounds():
    same, diff = (1.0, 1.0), (0.0, 1.0)
    rounds = _Rounds([[same, diff, same, diff], [diff, same, same, same], [diff, diff, diff, diff]], max_rounds=3)
    groups, scores, dropped, reward, metrics = _run(rounds)
    assert rounds.calls == [1, 2]  # round 0 + 1 give 3 informative groups: a third round is needed
    assert groups == [(0, 1), (0, 3), (1, 0), (2, 0)]
    assert scores == [0.0, 1.0] * 4
    assert metrics == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 5.0,
                       "dynamic_sampling/filled_groups": 0.0, "dynamic_sampling/surplus_groups": 3.0}
    assert reward == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/error_frac": 1 / 24}


def test_trainer_fills_with_all_equal_groups_at_max_rounds_and_skips_dropped_prompts():
    same, diff = (0.5, 0.5), (0.0, 0.25)
    rounds = _Rounds([[same, same, diff, same], [same, same, same, same]], max_rounds=2, dropped=(0,))
    groups, scores, dropped, reward, metrics = _run(rounds)
    assert rounds.calls == [1]
    assert groups == [(0, 2), (0, 1), (0, 3), (1, 0)]  # the dropped prompt 0 of round 0 has no group to fill with
    assert dropped == [(0, 0)]
    assert metrics["dynamic_sampling/filled_groups"] == 3.0 and metrics["dynamic_sampling/dropped_groups"] == 3.0
