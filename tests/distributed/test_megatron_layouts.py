"""Real megatron-core over gloo on CPU through megarl's platform layer: forward, backward and a
DistributedOptimizer step at TP=2, PP=2 (real pipeline schedule), DP=2 and TP=2xPP=2.

One 4-rank world runs every layout, several roles side by side (as a job with actor and critic would):
  phase A: TP=2 on ranks 0-1   and  PP=2 on ranks 2-3
  phase B: DP=2 on ranks 0-1   and  TP1PP1 (baseline) on rank 2  and  TP1PP1 with the embedding frozen by a
           model transform (`freeze_parameters`) on rank 3
  phase C: TP=2 x PP=2 on ranks 0-3
With pp=1 and CPU initialisation the initial weights do not depend on TP or DP, so TP=2 and DP=2 must reproduce
the single-rank baseline's losses before and after the optimizer step, and TP=2xPP=2 those of PP=2.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import group_by_case, next_token_ce_loss

VOCAB = 256  # pads to 256 at tp=1 and tp=2, so the embedding initialises identically
SEQ = 16
STEPS = 3


def _spec():
    from megarl.models.spec import ModelSpec

    return ModelSpec(
        architecture="LlamaForCausalLM", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        head_dim=16, ffn_hidden_size=128, vocab_size=VOCAB, max_position_embeddings=64,
    )


def _global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (4, SEQ), generator=g)


def _train(engine, micro_batches):
    """STEPS optimizer steps on a fixed batch; returns per-step (global mean loss, grad norm)."""
    import torch.distributed as dist

    loss_fn = next_token_ce_loss(engine)
    history = []
    for _ in range(STEPS):
        out = engine.run(micro_batches, loss_fn, forward_only=False)
        stats = engine.step()
        totals = torch.zeros(2, dtype=torch.float64)
        for m in out:  # only the last stage reports
            totals += torch.tensor([float(m["loss_sum"]), float(m["units"])], dtype=torch.float64)
        dist.all_reduce(totals, group=engine.groups.pgs.dp_cp)  # sum over data-parallel replicas
        loss = float(totals[0] / totals[1]) if engine.groups.is_last_stage else None
        history.append((loss, stats["grad_norm"]))
    return history


def _layout_worker(rank: int, world_size: int):
    from megarl.engine.megatron_engine import MegatronEngine, OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology

    spec = _spec()
    opt = OptimizerSettings(lr=5e-3, clip_grad=1.0)
    batch = _global_batch()
    two_micro = [{"input_ids": batch[:2]}, {"input_ids": batch[2:]}]
    results = {}

    def role(name, topo):
        groups = build_role_groups(topo)  # collective over all 4 ranks, even non-members
        if not groups.is_member:
            return
        engine = MegatronEngine(spec, groups, optimizer=opt, seed=1234)
        if topo.dp > 1:  # each DP replica takes its half of the global batch
            micro = [two_micro[groups.coord.dp]]
        else:
            micro = two_micro
        results[name] = {"coord": groups.coord, "last_stage": groups.is_last_stage, "history": _train(engine, micro)}

    role("tp2", RoleTopology(tp=2))
    role("pp2", RoleTopology(pp=2, rank_offset=2))
    role("dp2", RoleTopology(dp=2))
    role("tp1pp1", RoleTopology(rank_offset=2))
    frozen_role(RoleTopology(rank_offset=3), spec, opt, two_micro, results)
    role("tp2pp2", RoleTopology(tp=2, pp=2))
    return results


def frozen_role(topo, spec, opt, micro, results):
    """The tp1pp1 baseline's model with `freeze_parameters` on the word embedding (a transform between build and
    DDP): records each parameter before and after training, and what the optimizer holds."""
    from megarl.engine.megatron_engine import MegatronEngine, freeze_parameters
    from megarl.parallel.groups import build_role_groups

    groups = build_role_groups(topo)
    if not groups.is_member:
        return
    engine = MegatronEngine(spec, groups, optimizer=opt, seed=1234,
                            transforms=[freeze_parameters(lambda name: name.startswith("embedding."))])
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    history = _train(engine, micro)
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    optimized = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    results["frozen"] = {"history": history, "last_stage": True, "optimized": optimized,
                         "changed": {n: not torch.equal(before[n], after[n]) for n in before},
                         "numel": {n: p.numel() for n, p in engine.module.named_parameters()}}


@pytest.fixture(scope="module")
def layout_runs():
    return group_by_case(run_ranks(4, _layout_worker, timeout_s=900))


def _reported_losses(runs):
    return [[loss for loss, _ in r["history"]] for r in runs if r["last_stage"]]


@pytest.mark.parametrize("role,ranks", [("tp2", 2), ("pp2", 2), ("dp2", 2), ("tp2pp2", 4), ("tp1pp1", 1)])
def test_losses_finite_and_identical_on_reporting_ranks(layout_runs, role, ranks):
    runs = layout_runs[role]
    assert len(runs) == ranks
    losses = _reported_losses(runs)
    assert losses, f"{role}: no rank reported a loss"
    for per_rank in losses:
        assert all(math.isfinite(x) for x in per_rank), f"{role}: non-finite loss {per_rank}"
        assert per_rank == losses[0], f"{role}: ranks disagree: {losses}"
    # grad norms are reduced over the whole role: every rank sees the same value
    norms = [[g for _, g in r["history"]] for r in runs]
    for n in norms:
        assert n == pytest.approx(norms[0], rel=1e-6), f"{role}: grad norms differ across ranks: {norms}"
        assert all(math.isfinite(x) and x > 0 for x in n)


@pytest.mark.parametrize("role", ["tp2", "pp2", "dp2", "tp2pp2", "tp1pp1"])
def test_optimizer_steps_lower_the_loss(layout_runs, role):
    losses = _reported_losses(layout_runs[role])[0]
    assert losses[-1] < losses[0] - 0.05, f"{role}: loss did not fall over {STEPS} steps: {losses}"


@pytest.mark.parametrize("role,baseline_role", [("tp2", "tp1pp1"), ("dp2", "tp1pp1"), ("tp2pp2", "pp2")])
def test_layouts_reproduce_their_baseline(layout_runs, role, baseline_role):
    """Same initial weights (pp-dependent seeding aside) give the same losses before and after each step."""
    baseline = _reported_losses(layout_runs[baseline_role])[0]
    losses = _reported_losses(layout_runs[role])[0]
    assert losses == pytest.approx(baseline, abs=2e-5), f"{role} {losses} vs {baseline_role} {baseline}"
    # initial loss of a random model is close to ln(vocab)
    assert abs(baseline[0] - math.log(VOCAB)) < 0.5


def test_a_freezing_transform_keeps_its_parameters_out_of_ddp_and_the_optimizer(layout_runs):
    """build -> transforms -> DDP -> optimizer: the embedding frozen by a transform is not trained (bit-identical
    after 3 steps), every other parameter is, the optimizer holds exactly the others' elements, and the first loss is
    the baseline's (same initial weights: the transform changes nothing but what trains)."""
    frozen = layout_runs["frozen"][0]
    assert frozen["changed"]["embedding.word_embeddings.weight"] is False
    trained = {n: c for n, c in frozen["changed"].items() if not n.startswith("embedding.")}
    assert trained and all(trained.values()), trained
    # the distributed optimizer's param groups hold fp32 shards of exactly the trainable parameters (DP 1: whole)
    assert frozen["optimized"] == sum(frozen["numel"][n] for n in trained)
    baseline = _reported_losses(layout_runs["tp1pp1"])[0]
    losses = [loss for loss, _ in frozen["history"]]
    assert losses[0] == pytest.approx(baseline[0], abs=1e-6) and losses[1:] != pytest.approx(baseline[1:], abs=1e-6)
    assert losses[-1] < losses[0]
