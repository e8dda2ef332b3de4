"""Mixture-of-experts under virtual pipeline parallelism (megatron-core's interleaved 1F1B schedule) on real
megatron-core over gloo, 4 CPU ranks, fp32: a 4-layer tiny Qwen3-MoE (hidden 64, 4 experts, top-2, every layer MoE),
PP2xVPP2 = 4 chunks of one layer, so every chunk holds a router and the forwards of one micro-batch's routers run at
different times, interleaved with other micro-batches' (rank 0 holds layers 0 and 2, rank 1 layers 1 and 3).

The batch has 3 samples (6 at dp2) and the actor one sample per micro-batch: 3 micro-batches per DP rank, padded by
the engine with a filler to pp=2's multiple (the filler: a forward of the schedule's uniform shape, whose router
losses must be off and whose routing must be neither counted nor recorded). Samples have different lengths (12, 14,
10, ...), so every micro-batch is padded to the largest one's shape under VPP (that padding must not count either).

One spawn of 4 ranks:
  phase A: PP2xVPP2 actor (router aux and z-loss on) on ranks 0-1 | PP1 actor on rank 2 (the reference) | PP1 on
           6 samples on rank 3 (the reference of phase B)
  phase B: PP2xVPP2xEP2 (dp2, each rank 2 of the 4 experts) on ranks 0-3, router losses on, 6 samples
  phase C: TP2xPP2xVPP2 (sequence parallel) on ranks 0-3, router losses off (refused at tp > 1 with vpp > 1:
           `check_moe_vpp`): log-probs, recorded routing and expert load (the schedule's padding to one shape
           is routed there, as no padding mask reaches the routers under sequence parallelism, and must not count)
  phase D: routing replay `old` at PP2xVPP2 (ranks 0-1) | PP1 recording the same model's routing (rank 2)
Expected values: transformers' fp32 forward (log-probs) and the PP1 layout (weights after one update, expert-load
and router-loss metrics, recorded routing), itself checked against transformers and a hand-written AdamW step in
test_moe_roles.py. Adam lr = eps = 0.1 as in test_moe_roles.py (its module docstring: with eps 1e-8 Adam's first
step amplifies summation-order noise by lr/eps; here the step is ~g, so the weights compare the gradients).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megarl.parallel.topology import RoleTopology
from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.slow

B, S = 3, 16  # the first B of the 6 samples
PROMPT = [3, 5, 2, 4, 6, 3]
RESPONSE = [9, 9, 8, 6, 8, 10]  # lengths 12, 14, 10, 10, 14, 13
ADVANTAGE = [1.0, -1.0, 0.5, -0.5, 0.25, 1.0]
LR = ADAM_EPS = 0.1
REPLAY_LR = 0.05
AUX, Z = 0.01, 0.001
TOL = 1e-5
LAYERS = 4
# name -> (topology, vpp, router losses on, samples); one sample per micro-batch, so every VPP layout has 3
# micro-batches per DP rank (dp2: 6 samples), padded with a filler to pp=2's multiple
LAYOUTS = {
    "pp2vpp2": (RoleTopology(pp=2), 2, True, 3),
    "pp1": (RoleTopology(rank_offset=2), 1, True, 3),
    "pp1_b6": (RoleTopology(rank_offset=3), 1, True, 6),
    "pp2vpp2ep2": (RoleTopology(pp=2, dp=2, ep=2), 2, True, 6),
    "tp2pp2vpp2": (RoleTopology(tp=2, pp=2), 2, False, 3),
}
BASE = {"pp2vpp2": "pp1", "pp2vpp2ep2": "pp1_b6", "tp2pp2vpp2": "pp1"}  # the PP1 run each layout must equal
WEIGHTS_COMPARED = ("pp2vpp2", "pp1", "pp1_b6", "pp2vpp2ep2")  # one update with router losses on


def _batch(n: int = B):
    """The first n of 6 samples (right-padded to S)."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 300, (len(PROMPT), S), generator=g)[:n]
    pos = torch.arange(S).unsqueeze(0)
    plen = torch.tensor(PROMPT[:n]).unsqueeze(1)
    total = plen + torch.tensor(RESPONSE[:n]).unsqueeze(1)
    am = (pos < total).long()
    rm = ((pos >= plen) & (pos < total)).long()
    return Batch({"input_ids": ids * am, "attention_mask": am, "response_mask": rm})


def _advantages(batch):
    return torch.tensor(ADVANTAGE[:len(batch)]).unsqueeze(1) * batch["response_mask"]


def _worker(rank: int, world: int, hf_dir: str, replay_hf_dir: str, root: str):
    import torch.distributed as dist

    from megarl.checkpoint.dist_ckpt import megatron_to_hf, save_engine_checkpoint
    from megarl.engine.moe import MoeSettings
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.roles import Actor, BatchingSettings, OptimizerSettings

    spec = ModelSpec.from_hf_dir(hf_dir)
    res: dict = {}
    groups = {name: build_role_groups(topo) for name, (topo, *_) in LAYOUTS.items()}  # collective
    # phase A (pp2vpp2, pp1, pp1_b6 side by side), B (pp2vpp2ep2), C (tp2pp2vpp2); every rank in the same order
    phases = [("pp2vpp2", "pp1", "pp1_b6"), ("pp2vpp2ep2",), ("tp2pp2vpp2",)]
    for names in phases:
        actors = {}
        for name in names:
            _, vpp, losses, n = LAYOUTS[name]
            if not groups[name].is_member:
                continue
            batch = _batch(n)
            actor = Actor(spec, groups[name], optimizer=OptimizerSettings(lr=LR, eps=ADAM_EPS, clip_grad=1.0),
                          batching=BatchingSettings(micro_batch_samples=1), hf_dir=hf_dir, vpp=vpp,
                          moe=MoeSettings(aux_loss_coeff=AUX * losses, z_loss_coeff=Z * losses))
            before = actor.compute_log_probs(batch, record_routing=True)
            old = before["log_probs"] if before is not None else torch.zeros(n, S)
            metrics = actor.update(batch.update({"old_log_probs": old, "advantages": _advantages(batch)}))
            if before is not None and groups[name].coord.tp == 0 and actor.dp_rank == 0:
                res[(name, "log_probs")] = before["log_probs"].numpy()
                res[(name, "routed_experts")] = before["routed_experts"].numpy()
            if rank == min(groups[name].topology.ranks):
                res[(name, "metrics")] = metrics
            actors[name] = actor
        for name in names:  # collective
            if name in WEIGHTS_COMPARED:
                save_engine_checkpoint(actors[name].engine if name in actors else None, os.path.join(root, name),
                                       hf_dir=hf_dir)
        dist.barrier()
    for name in WEIGHTS_COMPARED:  # collective
        megatron_to_hf(os.path.join(root, name), os.path.join(root, f"{name}_hf"))

    # phase C: routing replay at PP2xVPP2; PP1 records the same model's routing for comparison
    replay_spec = ModelSpec.from_hf_dir(replay_hf_dir)
    batch = _batch(B)
    for name in ("pp2vpp2", "pp1"):  # side by side (ranks 0-1 | rank 2)
        vpp = LAYOUTS[name][1]
        if not groups[name].is_member:
            continue
        actor = Actor(replay_spec, groups[name], optimizer=OptimizerSettings(lr=REPLAY_LR, clip_grad=0.0),
                      batching=BatchingSettings(micro_batch_samples=1), hf_dir=replay_hf_dir, vpp=vpp,
                      router_replay="old")
        recorded = actor.compute_log_probs(batch)  # records routed_experts (router_replay="old")
        if name == "pp1":
            res["replay_pp1_recorded"] = recorded["routed_experts"].numpy()
            continue
        # the last stage holds the whole record (stages are summed); the update needs it on every stage
        rec = recorded["routed_experts"] if recorded is not None else torch.zeros(B, S, LAYERS, 2, dtype=torch.long)
        old = recorded["log_probs"] if recorded is not None else torch.zeros(B, S)
        dist.broadcast(rec, src=1, group=groups[name].pgs.pp)
        metrics = actor.update(batch.update({"old_log_probs": old, "routed_experts": rec,
                                             "advantages": _advantages(batch)}))
        own = actor.compute_log_probs(batch)  # the new weights' own routing
        replayed = actor.compute_log_probs(batch.update({"routed_experts": rec}), replay_routing=True)
        if recorded is not None:
            res["replay"] = {"recorded": rec.numpy(), "own": own["routed_experts"].numpy(),
                             "used": replayed["routed_experts"].numpy(), "update_metrics": metrics,
                             "diff_frac": actor.last_routing_diff_frac,
                             "logp_own": own["log_probs"].numpy(), "logp_replayed": replayed["log_probs"].numpy()}
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from safetensors.torch import load_file

    from megarl.checkpoint.tiny import make_hf_model
    from megarl.checkpoint.verify import hf_logits

    root = str(tmp_path_factory.mktemp("moe_vpp"))
    hf_dir = make_hf_model("qwen3_moe", os.path.join(root, "hf"), seed=0, num_hidden_layers=LAYERS)
    replay_hf_dir = make_hf_model("qwen3_moe", os.path.join(root, "hf_replay"), seed=1, num_hidden_layers=LAYERS)
    batch = _batch(len(PROMPT))
    logits = hf_logits(hf_dir, batch["input_ids"])[:, :-1]
    ref = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    ref = torch.nn.functional.pad(ref, (1, 0)) * batch["response_mask"]
    merged: dict = {}
    for r in run_ranks(4, _worker, hf_dir, replay_hf_dir, root, timeout_s=900):
        merged.update(r)
    weights = {name: load_file(os.path.join(root, f"{name}_hf", "model.safetensors")) for name in WEIGHTS_COMPARED}
    return {"ref_log_probs": ref, "out": merged, "weights": weights,
            "hf_weights": load_file(os.path.join(hf_dir, "model.safetensors"))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_log_probs_equal_transformers(runs, layout):
    ours = torch.from_numpy(runs["out"][(layout, "log_probs")])
    diff = (ours - runs["ref_log_probs"][:len(ours)]).abs().max().item()
    print(f"{layout}: max |log-prob diff| vs transformers {diff:.3g}")
    assert diff < TOL


@pytest.mark.parametrize("layout", ["pp2vpp2", "pp2vpp2ep2"])
def test_one_update_gives_the_same_weights_as_pp1(runs, layout):
    """Router aux and z-loss on, 3 micro-batches + 1 filler at PP2xVPP2 (at EP2 each DP rank has 2 of the 3
    samples' micro-batches, one of them real on one rank only: 2 + filler and 1 + filler): a filler's router losses
    (or a padded position's) would move the weights away from PP1's."""
    base, other, hf = runs["weights"][BASE[layout]], runs["weights"][layout], runs["hf_weights"]
    assert sorted(base) == sorted(other)
    worst, key = max(((base[k] - other[k]).abs().max().item(), k) for k in base)
    print(f"{layout}: max |weight diff| vs {BASE[layout]} after one update {worst:.3g} ({key})")
    assert worst < TOL
    assert all((base[k] - hf[k]).abs().max() > 0 for k in base)  # every tensor took part in the update
    got, want = runs["out"][(layout, "metrics")]["grad_norm"], runs["out"][(BASE[layout], "metrics")]["grad_norm"]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("layout", ["pp2vpp2", "pp2vpp2ep2", "tp2pp2vpp2"])
def test_expert_load_and_router_loss_metrics_equal_pp1(runs, layout):
    m, base = runs["out"][(layout, "metrics")], runs["out"][(BASE[layout], "metrics")]
    keys = ["moe_load_max_over_mean", "moe_load_max_over_mean_max", *(f"moe_load_max_over_mean_l{i}" for i in
                                                                        range(LAYERS))]
    if layout != "tp2pp2vpp2":  # router losses off there (0: not computed)
        keys += ["moe_aux_loss", "moe_z_loss"]
    for k in keys:
        print(f"{layout} {k}: {m[k]:.8g} {BASE[layout]} {base[k]:.8g}")
    assert base["moe_aux_loss"] > 0 and base["moe_z_loss"] > 0
    for k in keys:
        assert abs(m[k] - base[k]) < 1e-6 * max(1.0, abs(base[k])), k


def test_recorded_routing_equals_pp1(runs):
    """Each (chunk, micro-batch) forward's routing lands in its micro-batch's record: [B, S, L, k] equal to PP1's
    on every real token and layer (at TP2 each rank recorded its sequence-parallel slice)."""
    cases = [(name, runs["out"][(name, "routed_experts")], runs["out"][(BASE[name], "routed_experts")])
             for name in BASE]
    cases.append(("replay model", runs["out"]["replay"]["recorded"], runs["out"]["replay_pp1_recorded"]))
    for name, recorded, base in cases:
        valid = _batch(len(base))["attention_mask"].numpy().astype(bool)
        assert recorded.shape == base.shape == (len(base), S, LAYERS, 2)
        assert np.array_equal(np.sort(recorded, -1)[valid], np.sort(base, -1)[valid]), name


def test_replay_uses_the_recorded_experts_after_the_weights_changed(runs):
    r = runs["out"]["replay"]
    recorded, own, used = r["recorded"], r["own"], r["used"]
    valid = _batch()["attention_mask"].numpy().astype(bool)
    # the update with replay saw its own weights' routing = the recorded one (no step taken yet inside it)
    assert r["update_metrics"]["moe_routing_diff_frac"] == 0.0
    # after the step, the router's own choice differs for some tokens (the replay below has something to do)
    differs = (np.sort(own, -1) != np.sort(recorded, -1)).any(-1)  # [B, S, L]
    assert differs[valid].any()
    # with replay, the experts used are exactly the recorded ones, in every layer of every chunk
    assert np.array_equal(used[valid], recorded[valid])
    assert 0.0 < r["diff_frac"] <= 1.0
    assert np.abs(r["logp_own"] - r["logp_replayed"]).max() > 0
