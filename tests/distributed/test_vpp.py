"""Virtual pipeline parallelism (megatron-core's interleaved 1F1B schedule) on real megatron-core over gloo (4 CPU
ranks, fp32), with a 4-layer tiny Llama (pp*vpp = 4 chunks of one layer) and a 4-layer tied Qwen2.

One spawn of 4 ranks:
  phase A: actor PP2xVPP2 on ranks 0-1 (4 micro-batches)   actor PP2xVPP2 on ranks 2-3 (1 micro-batch, padded to
           pp=2 by the engine's filler)
  phase B: actor TP1PP1 on rank 0 (the reference layout)
  phase C: actor TP2xPP2xVPP2 on ranks 0-3 (token-budget micro-batches)
  phase D: conversion: each model loaded from HF straight into an engine at PP2xVPP2 (ranks 0-1), its logits, a
           megatron dist checkpoint saved from it and exported back to HF; the Llama checkpoint loaded at TP1PP1
           (rank 2); the PP2xVPP2 actor of phase A saves its train state (weights + optimizer) and a fresh PP2xVPP2
           actor resumes from it (ranks 0-1)
Expected values come from transformers (eager, fp32) and from the TP1PP1 layout (itself checked against
transformers in test_roles.py); the round trip is compared byte for byte with the source safetensors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megarl.checkpoint.tiny import make_hf_model
from megarl.platform.spawn import run_ranks
from tests.distributed.test_roles import (
    ACTOR_CLIP,
    ACTOR_LR,
    ADAM_EPS,
    ADVANTAGE,
    B,
    S,
    _batch,
    _hf_weights,
    _merged_weights,
    _np,
    assert_same_gradients,
    assert_same_update,
    hf_ppo_gradients,
    initial_weights,
    step_gradients,
)

pytestmark = pytest.mark.slow

LAYERS = 4
ARCHS = ("llama", "qwen2")  # untied; tied (the last chunk's output layer is a copy of chunk 0's embedding)
TOL = 1e-4


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))


def _actor_run(role, batch):
    before = role.compute_log_probs(batch)
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
    old = before["log_probs"] if before is not None else torch.zeros(B, S)
    metrics = role.update(batch.update({"old_log_probs": old, "advantages": adv}))
    after = role.compute_log_probs(batch)
    return {"before": _np(before), "after": _np(after), "metrics": metrics, "weights": _hf_weights(role),
            "last_stage": role.groups.is_last_stage,
            "layers": [[int(la.layer_number) for la in c.decoder.layers] for c in role.engine.chunks]}


def _reshard_into_vllm_tp2(engine, hf_dir: str) -> dict:
    """The hybrid path's reshard from this PP2xVPP2 engine into vLLM TP2 shards (planner holdings with `vpp=2`,
    sources from every chunk), into a dict sink; each shard compared with the HF slice vLLM's layout asks for."""
    import torch.distributed as dist

    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.layouts import TrainLayout
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from tests.distributed.test_reshard_executor import _expected_shards

    plan = plan_reshard(engine.spec, engine.groups.topology, 2, dtype_bytes=4, train_layout=TrainLayout(vpp=2))
    sink = DictSink()
    report = execute_reshard(plan, megatron_sources(engine), sink, bucket_bytes=64 << 10)
    expected = _expected_shards(hf_dir, engine.spec, 2, plan.infer_rank_of[dist.get_rank()])
    return {"mismatched": [k for k in expected if not torch.equal(expected[k], sink.tensors.get(k, torch.empty(0)))],
            "params": len(expected), "received": report.bytes_received, "lower_bound": report.bytes_lower_bound}


def _worker(rank: int, world: int, root: str):
    from megarl.checkpoint.dist_ckpt import load_engine_checkpoint, megatron_to_hf, save_engine_checkpoint
    from megarl.checkpoint.engine_io import build_engine_from_hf, engine_logits
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.roles import Actor, BatchingSettings, OptimizerSettings

    hf_dir = os.path.join(root, "llama")
    spec = ModelSpec.from_hf_dir(hf_dir)
    batch = _batch(spec.vocab_size)
    # Adam lr = eps = 0.1 (test_roles.py's docstring): the first step is ~g, so the weights after it compare the
    # gradients themselves (with eps 1e-8 a step is ~lr * sign(g), blind to a gradient scaled by a constant, and
    # elements whose gradient is ~1e-8 moved by ~0.1 lr with the summation order: 1 of 8192 o_proj elements off by
    # 2.4e-5 at TP2xPP2xVPP2)
    opt = OptimizerSettings(lr=ACTOR_LR, clip_grad=ACTOR_CLIP, eps=ADAM_EPS)
    res: dict = {}
    roles: dict = {}

    def actor(name, topo, batching, vpp):
        groups = build_role_groups(topo)
        if groups.is_member:
            role = Actor(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir, vpp=vpp)
            res[name] = _actor_run(role, batch)
            roles[name] = role

    actor("pp2vpp2", RoleTopology(pp=2), BatchingSettings(micro_batch_samples=1), vpp=2)
    actor("pp2vpp2_filler", RoleTopology(pp=2, rank_offset=2), BatchingSettings(micro_batch_samples=4), vpp=2)
    actor("tp1pp1", RoleTopology(), BatchingSettings(micro_batch_samples=1), vpp=1)
    actor("tp2pp2vpp2", RoleTopology(tp=2, pp=2), BatchingSettings(micro_batch_tokens=32), vpp=2)

    # conversion: HF -> engine (PP2xVPP2) -> dist checkpoint -> HF
    for arch in ARCHS:
        groups = build_role_groups(RoleTopology(pp=2))
        engine = build_engine_from_hf(os.path.join(root, arch), groups, vpp=2) if groups.is_member else None
        if engine is not None:
            logits = engine_logits(engine, _ids())
            if logits is not None:
                res[f"{arch}_logits"] = logits.numpy()  # numpy: a torch tensor's shared storage dies with the rank
            if arch == "llama":  # (vLLM's Qwen2 derives head_dim from hidden/heads: the tiny Qwen2 does not fit it)
                res[f"{arch}_reshard"] = _reshard_into_vllm_tp2(engine, os.path.join(root, arch))
        save_engine_checkpoint(engine, os.path.join(root, f"{arch}_ckpt"), hf_dir=os.path.join(root, arch))
        megatron_to_hf(os.path.join(root, f"{arch}_ckpt"), os.path.join(root, f"{arch}_hf"))
    # the PP2xVPP2 checkpoint read at another layout
    g1 = build_role_groups(RoleTopology(rank_offset=2))
    e1 = None
    if g1.is_member:
        from megarl.engine import MegatronEngine

        e1 = MegatronEngine(spec, g1)
    load_engine_checkpoint(e1, os.path.join(root, "llama_ckpt"))
    if e1 is not None:
        res["llama_logits_tp1_from_vpp"] = engine_logits(e1, _ids()).numpy()
    # train state (weights + optimizer) of the updated PP2xVPP2 actor, resumed by a fresh PP2xVPP2 actor
    trained = roles.get("pp2vpp2")
    save_engine_checkpoint(trained.engine if trained else None, os.path.join(root, "train_ckpt"), hf_dir=hf_dir,
                           with_optimizer=True)
    rg = build_role_groups(RoleTopology(pp=2))
    resumed = Actor(spec, rg, optimizer=opt, batching=BatchingSettings(micro_batch_samples=1), vpp=2) \
        if rg.is_member else None
    load_engine_checkpoint(resumed.engine if resumed else None, os.path.join(root, "train_ckpt"), with_optimizer=True)
    for name, role in (("continued", trained), ("resumed", resumed)):
        if role is not None:  # a second identical update from the same state gives the same weights
            adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
            lp = role.compute_log_probs(batch)
            old = lp["log_probs"] if lp is not None else torch.zeros(B, S)
            role.update(batch.update({"old_log_probs": old, "advantages": adv}))
            res[name] = {"weights": _hf_weights(role), "steps": role.engine.steps}
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vpp")
    for seed, arch in enumerate(ARCHS):
        make_hf_model(arch, str(root / arch), seed=5 + seed, num_hidden_layers=LAYERS)
    per_rank = run_ranks(4, _worker, str(root), timeout_s=900)
    merged: dict[str, list] = {}
    for r in per_rank:
        for k, v in r.items():
            merged.setdefault(k, []).append(v)
    return {"root": str(root), "res": merged}


def _hf_log_probs(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        lp = torch.log_softmax(model(batch["input_ids"]).logits.float(), -1)
    ref = torch.zeros(B, S)
    ref[:, 1:] = lp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return ref * batch["response_mask"]


def _last(runs, name):
    outs = [r for r in runs["res"][name] if r["last_stage"]]
    assert outs, name
    return outs


VPP_LAYOUTS = ["pp2vpp2", "pp2vpp2_filler", "tp2pp2vpp2"]


def test_chunks_hold_megatrons_interleaved_layers(runs):
    """Pipeline rank r, chunk c holds global chunk r + c*pp: with 4 layers, pp2 x vpp2, rank 0 has layers 1 and 3,
    rank 1 has layers 2 and 4 (megatron's 1-based layer numbers)."""
    ranks = runs["res"]["pp2vpp2"]
    assert sorted(r["layers"] for r in ranks) == [[[1], [3]], [[2], [4]]]


@pytest.mark.parametrize("layout", VPP_LAYOUTS)
def test_vpp_log_probs_match_transformers(runs, layout):
    ref = _hf_log_probs(os.path.join(runs["root"], "llama"))
    for r in _last(runs, layout):
        torch.testing.assert_close(torch.from_numpy(r["before"]["log_probs"]), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", VPP_LAYOUTS)
def test_vpp_update_equals_tp1pp1(runs, layout):
    base = _last(runs, "tp1pp1")[0]
    initial = initial_weights(os.path.join(runs["root"], "llama"))
    assert_same_update(runs["res"][layout], runs["res"]["tp1pp1"], base["metrics"], ("loss", "grad_norm"), initial)
    for r in _last(runs, layout):
        np.testing.assert_allclose(r["after"]["log_probs"], base["after"]["log_probs"], atol=1e-5, rtol=0)
    assert runs["res"][layout][0]["metrics"]["optimizer_steps"] == 1


def test_vpp_base_tp1pp1_update_is_a_step_on_transformers_gradients(runs):
    """The 4-layer model's TP1PP1 update (the base above): every tensor's gradient recovered from the step is
    transformers' (test_roles.hf_ppo_gradients) and so is the gradient norm."""
    hf_dir = os.path.join(runs["root"], "llama")
    want, norm = hf_ppo_gradients(hf_dir)
    assert_same_gradients(step_gradients(_merged_weights(runs["res"]["tp1pp1"]), initial_weights(hf_dir)), want,
                          "vpp tp1pp1 vs transformers")
    assert _last(runs, "tp1pp1")[0]["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_vpp_conversion_logits_match_transformers(runs, arch):
    from megarl.checkpoint.verify import hf_logits

    ref = hf_logits(os.path.join(runs["root"], arch), _ids())
    ours = torch.from_numpy(runs["res"][f"{arch}_logits"][0])
    assert (ours - ref).abs().max().item() <= TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("arch", ARCHS)
def test_vpp_round_trip_is_bit_exact(runs, arch):
    from safetensors.torch import load_file

    before = load_file(os.path.join(runs["root"], arch, "model.safetensors"))
    after = load_file(os.path.join(runs["root"], f"{arch}_hf", "model.safetensors"))
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


def test_vpp_reshard_into_vllm_tp2_at_the_lower_bound(runs):
    ranks = runs["res"]["llama_reshard"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["mismatched"] == [] and r["params"] > 0
        assert r["received"] == r["lower_bound"] > 0


def test_vpp_checkpoint_loads_at_tp1pp1(runs):
    from megarl.checkpoint.verify import hf_logits

    ours = torch.from_numpy(runs["res"]["llama_logits_tp1_from_vpp"][0])
    ref = hf_logits(os.path.join(runs["root"], "llama"), _ids())
    assert (ours - ref).abs().max().item() <= TOL


def test_vpp_train_state_resumes(runs):
    """A fresh PP2xVPP2 actor loaded from the updated actor's checkpoint (weights + Adam moments + step) makes the
    same second update as the actor that kept running."""
    cont = _merged_weights(runs["res"]["continued"])
    res = _merged_weights(runs["res"]["resumed"])
    first = _merged_weights(runs["res"]["pp2vpp2"])
    for k in cont:
        np.testing.assert_allclose(res[k], cont[k], atol=1e-6, rtol=0, err_msg=k)
    assert any(np.abs(cont[k] - first[k]).max() > 1e-6 for k in cont)  # the second update moved the weights
    assert {r["steps"] for r in runs["res"]["resumed"]} == {2}
