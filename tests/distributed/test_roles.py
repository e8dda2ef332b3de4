"""Actor, reference, critic and reward-model roles on real megatron-core over gloo (4 CPU ranks, fp32).

One spawn of 4 ranks runs every layout side by side, all loaded from the same tiny HF Llama (GQA, llama3 rope):
  phase A: actor TP=2 on ranks 0-1            actor PP=2 on ranks 2-3
  phase B: actor DP=2 on ranks 0-1            actor TP1PP1 on rank 2, reference TP1 on rank 3
           (then on rank 3: an SFT actor, and a decoupled-PPO actor: old and rollout log-probs that differ)
  phase C: actor TP=2 x PP=2 on ranks 0-3, then CP=2 on ranks 0-1, then TP=2 x CP=2 on ranks 0-3
  phase D: critic TP=2 on ranks 0-1 (update, dist-checkpoint save)    reward model PP=2 on ranks 2-3
  phase E: critic PP=2 on ranks 2-3, loaded from phase D's checkpoint
Each actor computes log-probs, makes one PPO update (each layout with different micro-batching: fixed count or
token budget) and computes log-probs again; its updated weights come back in HF layout. The parent compares
layouts with each other and with transformers (eager, fp32).

Why the actor's Adam has lr = eps = 0.1 (the theory of tests/distributed/test_moe_roles.py). Adam's first step moves
every weight by u(g) = lr * g / (|g| + eps) (g the clipped gradient). At the usual eps = 1e-8 that is ~lr * sign(g):
the weights after one step cannot see a gradient scaled by a constant (a norm weight's gradient missing a
reduction, x2 or x0.5, gave the same weights). With lr = eps = 0.1 the slope du/dg is at most 1, so u ~ g for the
gradients here and a summation-order noise of 1e-9 stays 1e-9; `gradient_from_step` inverts u, and every layout's
gradients, tensor by tensor, are compared with TP1PP1's (`assert_same_update`), whose gradients are compared with
transformers' own (loss.backward() of the same PPO loss on the HF model, clipped the same way: `hf_ppo_gradients`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import padded_random_batch

B, S = 4, 16
PROMPT = [3, 5, 2, 4]
RESPONSE = [9, 6, 12, 8]
ACTOR_LR = 0.1
ADAM_EPS = 0.1  # see the module docstring: Adam's first step is then ~g, not lr * sign(g)
ACTOR_CLIP = 1.0
GRAD_TOL = 1e-4  # per tensor: max |grad diff| / max |grad| (test_moe_roles.py measured < 1e-4 across layouts)
ADVANTAGE = [1.0, -1.0, 0.5, -0.5]  # per sample, on every response token
ROLLOUT_OFFSET = 0.1  # the fused-update test's rollout log-probs: the actor's minus this, on every response token
# Decoupled PPO (the actor's update with a rollout correction, as an async run trains): proximal (`old_log_probs`,
# recomputed by the trainer) and behaviour (`rollout_log_probs`, the stale engine's) log-probs set off the policy's
# own by these ratios, cycled over each row's response tokens (lengths 5 and 3: every pair occurs)
PROX_RATIOS = [1.5, 0.6, 1.1, 1.0, 0.9]  # pi / proximal: PPO's ratio (clipped above 1.28 and below 0.8)
BEHAVIOUR_RATIOS = [3.0, 0.5, 1.25]  # proximal / behaviour: the token's importance weight (truncated at 2)
DECOUPLED_CLIP = (0.2, 0.28)  # clip_low, clip_high
TIS_C = 2.0


def _batch(vocab: int):
    return padded_random_batch(PROMPT, RESPONSE, S, vocab, seed=11)


def _np(batch):
    return None if batch is None else {k: v.numpy().copy() for k, v in batch.tensors.items()}


def _hf_weights(role) -> dict:
    """This rank's parameters written into full HF-layout tensors (NaN where other ranks hold the values)."""
    from megarl.checkpoint.engine_io import named_layouts
    from megarl.checkpoint.name_map import hf_shapes, scatter_shard

    engine = role.engine
    shapes = hf_shapes(engine.spec)
    out: dict[str, torch.Tensor] = {}
    for _name, param, layout in named_layouts(engine):
        full = {n: out.setdefault(n, torch.full(shapes[n], float("nan"))) for n in layout.hf_names}
        scatter_shard(engine.spec, layout, engine.groups.coord.tp, engine.groups.topology.tp, param.detach(), full)
    return {k: v.numpy() for k, v in out.items()}


def _actor_run(role, batch):
    from megarl.controller.dispatch import split_contiguous

    before = role.compute_log_probs(batch)
    # the controller's DP_SPLIT path: this DP rank gets only its (uneven for dp=2: 2 + 1 samples) share of 3 samples
    share = role.compute_log_probs(split_contiguous(batch.slice(0, 3), role.dp)[role.dp_rank], share=True)
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
    old = before["log_probs"] if before is not None else torch.zeros(B, S)
    metrics = role.update(batch.update({"old_log_probs": old, "advantages": adv}))
    after = role.compute_log_probs(batch)
    return {"before": _np(before), "after": _np(after), "metrics": metrics, "weights": _hf_weights(role),
            "last_stage": role.groups.is_last_stage, "share": _np(share), "dp_rank": role.dp_rank}


def _decoupled_offsets(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log(pi / proximal) and log(proximal / behaviour) [B, S] on the response tokens (PROX_RATIOS,
    BEHAVIOUR_RATIOS cycled over each row's tokens), 0 elsewhere."""
    d_prox, d_behav = torch.zeros(mask.shape), torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for j, pos in enumerate(mask[i].nonzero()[:, 0].tolist()):
            d_prox[i, pos] = math.log(PROX_RATIOS[j % len(PROX_RATIOS)])
            d_behav[i, pos] = math.log(BEHAVIOUR_RATIOS[j % len(BEHAVIOUR_RATIOS)])
    return d_prox, d_behav


def _decoupled_update(spec, groups, hf_dir, batch, opt) -> dict:
    """One decoupled-PPO update (tis=token, c=2) through `Actor.update`, the call the trainer makes: proximal =
    the actor's own log-probs (the weights it updates) / PROX_RATIOS, behaviour = proximal / BEHAVIOUR_RATIOS."""
    from megarl.roles import Actor, BatchingSettings, PolicyLossSettings

    loss = PolicyLossSettings(name="ppo", clip_low=DECOUPLED_CLIP[0], clip_high=DECOUPLED_CLIP[1],
                              rollout_tis="token", rollout_c=TIS_C)
    role = Actor(spec, groups, optimizer=opt, batching=BatchingSettings(micro_batch_samples=2), hf_dir=hf_dir,
                 loss=loss)
    mask = batch["response_mask"]
    pi = role.compute_log_probs(batch, with_entropy=False)["log_probs"]
    d_prox, d_behav = _decoupled_offsets(mask)
    proximal = (pi - d_prox) * mask
    behaviour = (proximal - d_behav) * mask
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * mask
    metrics = role.update(batch.update({"old_log_probs": proximal, "rollout_log_probs": behaviour,
                                        "advantages": adv}))
    return {"metrics": metrics, "weights": _hf_weights(role), "last_stage": True}


def _dp2_mini_batch_updates(spec, groups, hf_dir, batch, before) -> dict:
    """DP=2, two mini-batches of 2 samples, 2 epochs, three times from the same HF weights: on the controller's cut
    (`Dispatch.DP_SPLIT_MINI_BATCHES`: this rank's part of every mini-batch, `share=True`), on the whole batch on
    every rank (the RANK_ZERO path `update_actor` had before), and as one update call per mini-batch with the rows
    worked out by hand (mini-batch j = rows 2j, 2j+1; each call cuts its 2 rows over the 2 DP ranks, rank k
    training on row 2j+k). Returns each one's weights and metrics, and which rows of `batch` the cut gave us."""
    from megarl.controller.dispatch import DP_SPLIT_MINI_BATCHES, DispatchSpec, plan_calls
    from megarl.roles import Actor, BatchingSettings, OptimizerSettings

    opt = OptimizerSettings(lr=1e-2, clip_grad=ACTOR_CLIP)
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
    full = batch.update({"old_log_probs": torch.from_numpy(before["log_probs"]), "advantages": adv})

    def fresh(batching):
        return Actor(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir)

    two_minis = BatchingSettings(micro_batch_samples=1, mini_batch_samples=2, epochs=2)
    cut = DispatchSpec(DP_SPLIT_MINI_BATCHES, mini_batch_attr="actor_mini_batch_samples")
    piece = plan_calls(cut, (full,), {}, 2, [0, 1], mini_batch_samples=2)[groups.coord.dp][0][0]
    rows = [next(i for i in range(B) if torch.equal(batch["input_ids"][i], r)) for r in piece["input_ids"]]
    out = {"dp_rank": groups.coord.dp, "rows": rows}
    split = fresh(two_minis)
    out["split"] = {"metrics": split.update(piece, share=True), "weights": _hf_weights(split)}
    whole = fresh(two_minis)
    out["whole"] = {"metrics": whole.update(full), "weights": _hf_weights(whole)}
    by_call = fresh(BatchingSettings(micro_batch_samples=1))
    for _epoch in range(2):
        for j in range(2):
            by_call.update(full.index([2 * j, 2 * j + 1]))
    out["by_call"] = {"weights": _hf_weights(by_call)}
    return out


def _worker(rank: int, world: int, hf_dir: str, hf_rm_dir: str, ckpt_dir: str):
    from megarl.checkpoint.dist_ckpt import load_engine_checkpoint, save_engine_checkpoint
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.roles import (
        Actor,
        BatchingSettings,
        Critic,
        OptimizerSettings,
        PolicyLossSettings,
        Reference,
        RewardModel,
    )

    spec = ModelSpec.from_hf_dir(hf_dir)
    batch = _batch(spec.vocab_size)
    opt = OptimizerSettings(lr=ACTOR_LR, eps=ADAM_EPS, clip_grad=ACTOR_CLIP)
    res: dict = {}

    def actor(name, topo, batching):
        groups = build_role_groups(topo)
        if groups.is_member:
            role = Actor(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir)
            res[name] = _actor_run(role, batch)
            return role

    actor("tp2", RoleTopology(tp=2), BatchingSettings(micro_batch_tokens=24))
    actor("pp2", RoleTopology(pp=2, rank_offset=2), BatchingSettings(micro_batch_samples=2))

    def fused(name, topo, batching):
        """The same update with no old_log_probs in the batch: the actor takes them from its own forward, and
        measures the mismatch against rollout log-probs offset by ROLLOUT_OFFSET from its pre-update ones."""
        groups = build_role_groups(topo)
        if groups.is_member:
            role = Actor(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir)
            before = role.compute_log_probs(batch)
            lp = before["log_probs"] if before is not None else torch.zeros(B, S)
            rollout = (lp - ROLLOUT_OFFSET) * batch["response_mask"]
            adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
            metrics = role.update(batch.update({"advantages": adv, "rollout_log_probs": rollout}))
            res[name] = {"metrics": metrics, "weights": _hf_weights(role), "last_stage": role.groups.is_last_stage}

    fused("tp2_fused", RoleTopology(tp=2), BatchingSettings(micro_batch_tokens=24))
    fused("pp2_fused", RoleTopology(pp=2, rank_offset=2), BatchingSettings(micro_batch_samples=2))
    dp2 = actor("dp2", RoleTopology(dp=2), BatchingSettings(micro_batch_tokens=20))
    if dp2 is not None:
        res["dp2_mini_batches"] = _dp2_mini_batch_updates(spec, dp2.groups, hf_dir, batch, res["dp2"]["before"])
    base = actor("tp1pp1", RoleTopology(rank_offset=2), BatchingSettings(micro_batch_samples=1))
    ref_groups = build_role_groups(RoleTopology(rank_offset=3))
    if ref_groups.is_member:
        ref = Reference(spec, ref_groups, hf_dir=hf_dir, batching=BatchingSettings(micro_batch_tokens=64))
        first = ref.compute_log_probs(batch)
        moved = ref.offload()
        state = {"moved": moved, "offloaded": ref.engine.offloaded,
                 "zero_bytes": all(p.untyped_storage().nbytes() == 0 for p in ref.engine.module.parameters())}
        try:
            ref.compute_log_probs(batch)
            state["run_while_offloaded"] = "ran"
        except RuntimeError as e:
            state["run_while_offloaded"] = str(e)
        ref.reload()
        res["reference"] = {"first": _np(first), "second": _np(ref.compute_log_probs(batch)), "offload": state}
    sft_groups = build_role_groups(RoleTopology(rank_offset=3))
    if sft_groups.is_member:  # SFT warm-up through the same update path: cross-entropy on response tokens
        sft = Actor(spec, sft_groups, optimizer=OptimizerSettings(lr=1e-3), loss=PolicyLossSettings(name="sft"),
                    hf_dir=hf_dir, batching=BatchingSettings(micro_batch_samples=3))
        res["sft"] = [sft.update(batch)["loss"] for _ in range(3)]
    decoupled_groups = build_role_groups(RoleTopology(rank_offset=3))
    if decoupled_groups.is_member:
        res["decoupled"] = _decoupled_update(spec, decoupled_groups, hf_dir, batch, opt)
    for role in (dp2, base):  # a trained role offloads everything and comes back unchanged
        if role is not None:
            lp = role.compute_log_probs(batch)
            moved = role.offload()
            role.reload()
            same = bool(torch.equal(lp["log_probs"], role.compute_log_probs(batch)["log_probs"]))
            # in stages, as the trainer does: training state after the update, parameters after the reshard
            staged = [role.offload(params=False), role.offload()]
            role.reload(("params",))  # what the reshard needs
            params_back = list(role.engine.offloaded)
            role.reload()
            same_staged = bool(torch.equal(lp["log_probs"], role.compute_log_probs(batch)["log_probs"]))
            res.setdefault("trained_offload", []).append(
                {"moved": moved, "same": same, "staged": staged, "params_back": params_back, "same_staged": same_staged}
            )
    actor("tp2pp2", RoleTopology(tp=2, pp=2), BatchingSettings(micro_batch_tokens=32))
    # context parallel (all-gather KV attention on CPU: megarl.models.context_parallel); micro-batch lengths 15 and
    # 16 are padded to multiples of 2*cp inside the engine
    actor("cp2", RoleTopology(cp=2), BatchingSettings(micro_batch_tokens=24))
    actor("tp2cp2", RoleTopology(tp=2, cp=2), BatchingSettings(micro_batch_samples=2))

    # critic and reward model
    critic_opt = OptimizerSettings(lr=1e-4, clip_grad=1.0)
    returns = torch.tensor([1.0, -1.0, 0.5, 0.0]).unsqueeze(1) * batch["response_mask"]
    cg = build_role_groups(RoleTopology(tp=2))
    critic = None
    if cg.is_member:
        critic = Critic(spec, cg, optimizer=critic_opt, hf_dir=hf_rm_dir, value_clip=0.2,
                        batching=BatchingSettings(micro_batch_tokens=32))
        v0 = critic.compute_values(batch)
        cb = batch.update({"old_values": v0["values"], "returns": returns})
        m = critic.update(cb)
        res["critic"] = {"v0": _np(v0), "v1": _np(critic.compute_values(batch)), "metrics": m,
                         "head": {k: v.numpy() for k, v in critic.head_state_dict().items()}}
    rg = build_role_groups(RoleTopology(pp=2, rank_offset=2))
    if rg.is_member:
        rm = RewardModel(spec, rg, hf_dir=hf_rm_dir, batching=BatchingSettings(micro_batch_samples=3))
        res["reward"] = _np(rm.score(batch))
    save_engine_checkpoint(critic.engine if critic else None, ckpt_dir)  # collective over the world
    cg2 = build_role_groups(RoleTopology(pp=2, rank_offset=2))
    critic2 = Critic(spec, cg2, optimizer=critic_opt) if cg2.is_member else None  # random init, then load
    load_engine_checkpoint(critic2.engine if critic2 else None, ckpt_dir)
    if critic2 is not None:
        res["critic_reloaded"] = _np(critic2.compute_values(batch))
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from megarl.checkpoint.tiny import make_hf_model

    root = tmp_path_factory.mktemp("roles")
    hf_dir = make_hf_model("llama", str(root / "hf"), seed=5)
    # a value/reward model directory: the same body plus transformers' `score.weight` head
    rm_dir = make_hf_model("llama", str(root / "hf_rm"), seed=5)
    tensors = load_file(f"{rm_dir}/model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["score.weight"] = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)) * 0.1
    save_file(tensors, f"{rm_dir}/model.safetensors", metadata={"format": "pt"})
    per_rank = run_ranks(4, _worker, hf_dir, rm_dir, str(root / "critic_ckpt"), timeout_s=600)
    by_role: dict[str, list] = {}
    for r in per_rank:
        for k, v in r.items():
            by_role.setdefault(k, []).extend(v if isinstance(v, list) else [v])
    return {"roles": by_role, "hf_dir": hf_dir, "rm_dir": rm_dir, "score": tensors["score.weight"],
            "initial": initial_weights(hf_dir)}


@functools.lru_cache(maxsize=4)
def _hf_forward(path):
    """transformers' (eager, fp32) forward of `_batch` (no grad); cached: the tests only read it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        out = model(batch["input_ids"], output_hidden_states=True)
    return batch, out


def _hf_token_log_probs(runs) -> torch.Tensor:
    """transformers' log-softmax of each response token, token-aligned [B, S] (0 off the response)."""
    batch, out = _hf_forward(runs["hf_dir"])
    lp = torch.log_softmax(out.logits.float(), -1)
    ref = torch.zeros(B, S)
    ref[:, 1:] = lp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return ref * batch["response_mask"]


def _last_stage(runs, role):
    outs = [r for r in runs["roles"][role] if r["last_stage"]]
    assert outs, f"{role}: no last-stage result"
    return outs


def assert_same_update(results, base_results, base_metrics: dict, metric_keys, initial: dict) -> None:
    """One layout's update equals the base layout's: every merged HF-layout weight within 1e-5, every tensor's
    gradient (recovered from the step, `gradient_from_step`; `initial` = the HF weights before it) within GRAD_TOL
    of that tensor's largest, and the named metrics (of the layout's first rank) within rel 1e-5."""
    want, got = _merged_weights(base_results), _merged_weights(results)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-5, rtol=0, err_msg=k)
    assert_same_gradients(step_gradients(got, initial), step_gradients(want, initial), "vs base layout")
    m = results[0]["metrics"]
    for key in metric_keys:
        assert m[key] == pytest.approx(base_metrics[key], rel=1e-5, abs=1e-6), key


def initial_weights(hf_dir: str) -> dict[str, np.ndarray]:
    """The HF checkpoint every role loads (the weights before the update), by HF name."""
    import os

    from safetensors.numpy import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def gradient_from_step(before: np.ndarray, after: np.ndarray, lr: float = ACTOR_LR,
                       eps: float = ADAM_EPS) -> np.ndarray:
    """The clipped gradient g of Adam's first step (bias-corrected m = g, v = g^2), from u = before - after =
    lr * g / (|g| + eps): |g| = eps * |u| / (lr - |u|), sign of u. float64, the shape of the tensor."""
    u = before.astype(np.float64) - after.astype(np.float64)
    assert np.abs(u).max() < lr, "a step of lr or more is not an Adam first step"
    return np.sign(u) * eps * np.abs(u) / (lr - np.abs(u))


def step_gradients(after: dict[str, np.ndarray], initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`gradient_from_step` of every HF tensor: merged weights after one update vs `initial`."""
    assert sorted(after) == sorted(initial)
    return {k: gradient_from_step(initial[k], after[k]) for k in initial}


def assert_same_gradients(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str,
                          tol: float = GRAD_TOL) -> float:
    """Every tensor's max |got - want| within `tol` of max |want| of that tensor (so a gradient scaled by a
    constant, lost on one rank or missing a reduction fails even where the global norm would hide it); every
    tensor took part (max |want| > 0). Returns the worst ratio."""
    assert sorted(got) == sorted(want)
    worst = (0.0, "")
    for k in want:
        scale = np.abs(want[k]).max()
        assert scale > 0, f"{k}: no gradient"
        worst = max(worst, (float(np.abs(got[k] - want[k]).max() / scale), k))
    print(f"{what}: worst per-tensor max |grad diff| / max |grad| {worst[0]:.3g} ({worst[1]})")
    assert worst[0] < tol, worst
    return worst[0]


def hf_ppo_gradients(hf_dir: str, batch=None, advantage=ADVANTAGE,
                     clip: float = ACTOR_CLIP) -> tuple[dict[str, np.ndarray], float]:
    """transformers' gradients of the update's loss on `batch` (default `_batch`; right-padded [B, S] input_ids and
    response_mask), clipped as megatron clips them.

    The PPO loss at ratio 1 (old log-probs = the detached current ones, so no clipping): token mean over the
    response tokens of -A * exp(logp - old), A = `advantage[i]` on sample i, no entropy or KL term. loss.backward()
    on the HF model (eager, fp32, causal: the right padding is invisible to real tokens), then megatron's
    clip_grad_by_total_norm: g * clip / (norm + 1e-6) when that is < 1.
    Returns ({HF name: clipped gradient, float64}, the global L2 norm before clipping)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size) if batch is None else batch
    ids, mask = batch["input_ids"], batch["response_mask"].float()
    logits = model(ids).logits[:, :-1]
    logp = torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    adv = torch.tensor(advantage).unsqueeze(1) * mask
    loss = (-adv * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    loss.backward()
    grads = {k: p.grad.double() for k, p in model.named_parameters()}
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    coeff = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    return {k: (g * coeff).numpy() for k, g in grads.items()}, norm


def hf_decoupled_gradients(hf_dir: str, clip: float = ACTOR_CLIP) -> dict[str, np.ndarray]:
    """transformers' gradients of decoupled PPO's loss on `_batch`, written from the formula (Hilton et al. 2022):
    per response token, r = pi / proximal = exp(logp - (logp.detach() - log PROX_RATIO)), w = min(BEHAVIOUR_RATIO,
    c) (proximal / behaviour, a constant), L = w * max(-A r, -A clip(r, 1 - 0.2, 1 + 0.28)); token mean; clipped
    by the global norm as megatron clips. {HF name: gradient, float64}."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size)
    ids, mask = batch["input_ids"], batch["response_mask"].float()
    d_prox, d_behav = _decoupled_offsets(batch["response_mask"])
    logits = model(ids).logits[:, :-1]
    logp = torch.nn.functional.pad(torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * mask
    ratio = torch.exp(logp - (logp.detach() - d_prox))
    low, high = DECOUPLED_CLIP
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - low, 1 + high))
    weight = torch.exp(d_behav).clamp(max=TIS_C)
    loss = (weight * per_token * mask).sum() / mask.sum()
    loss.backward()
    grads = {k: p.grad.double() for k, p in model.named_parameters()}
    norm = float(torch.sqrt(sum((g**2).sum() for g in grads.values())))
    coeff = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    return {k: (g * coeff).numpy() for k, g in grads.items()}


def _merged_weights(results) -> dict[str, np.ndarray]:
    merged = {}
    for r in results:
        for k, v in r["weights"].items():
            m = merged.setdefault(k, np.full_like(v, np.nan))
            have = ~np.isnan(v)
            both = have & ~np.isnan(m)
            assert np.array_equal(m[both], v[both]), f"replicas disagree on {k}"
            m[have] = v[have]
    for k, m in merged.items():
        assert not np.isnan(m).any(), f"{k}: some entries held by no rank"
    return merged


LAYOUTS = ["tp1pp1", "tp2", "pp2", "dp2", "tp2pp2", "cp2", "tp2cp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_match_transformers(runs, layout):
    batch, out = _hf_forward(runs["hf_dir"])
    lp = torch.log_softmax(out.logits.float(), -1)
    ref = _hf_token_log_probs(runs)
    for r in _last_stage(runs, layout):
        got = torch.from_numpy(r["before"]["log_probs"])
        assert got.shape == (B, S)
        assert torch.all(got[batch["response_mask"] == 0] == 0)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        ent = torch.from_numpy(r["before"]["entropy"])
        want = -(lp.exp() * lp).sum(-1)
        want = torch.nn.functional.pad(want[:, :-1], (1, 0)) * batch["response_mask"]
        torch.testing.assert_close(ent, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dp_shares_concatenated_in_order_match_transformers(runs, layout):
    # each DP rank computed only its share of the first 3 samples (share=True, no DP all-gather); the shares in
    # DP-rank order are transformers' log-probs of those samples
    ref = _hf_token_log_probs(runs)[:3]
    by_dp = {r["dp_rank"]: torch.from_numpy(r["share"]["log_probs"]) for r in _last_stage(runs, layout)}
    parts = [by_dp[k] for k in sorted(by_dp)]
    if layout == "dp2":
        assert [len(p) for p in parts] == [2, 1]
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_layouts_agree_before_and_after_one_update(runs, layout):
    base = _last_stage(runs, "tp1pp1")[0]
    # the update first: its failure names the tensor whose gradient differs
    assert_same_update(runs["roles"][layout], runs["roles"]["tp1pp1"], base["metrics"],
                       ("loss", "grad_norm", "entropy"), runs["initial"])
    for r in _last_stage(runs, layout):
        np.testing.assert_allclose(r["before"]["log_probs"], base["before"]["log_probs"], atol=1e-5, rtol=0)
        np.testing.assert_allclose(r["after"]["log_probs"], base["after"]["log_probs"], atol=1e-5, rtol=0)


def test_tp1pp1_update_is_a_step_on_transformers_gradients(runs):
    """The base layout of the comparisons above is itself checked against transformers: the gradient of every
    tensor recovered from its step equals HF's (loss.backward() of the same loss, clipped the same way) and its
    reported gradient norm (before clipping) is HF's."""
    want, norm = hf_ppo_gradients(runs["hf_dir"])
    got = step_gradients(_merged_weights(runs["roles"]["tp1pp1"]), runs["initial"])
    assert_same_gradients(got, want, "tp1pp1 vs transformers")
    assert _last_stage(runs, "tp1pp1")[0]["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_decoupled_ppo_update_clips_against_the_proximal_policy_and_weights_by_proximal_over_behaviour(runs):
    """The actor's update with rollout log-probs (behaviour) and old log-probs (proximal) that differ, as an async
    run's stale batch has them: the loss, clip fraction and importance weights equal decoupled PPO's computed by
    hand from the ratios the batch was built with (not from megarl's losses), and the step's gradient is
    transformers' gradient of that loss. Clipping against the behaviour log-probs, or swapping proximal and
    behaviour in the importance weight, changes all three."""
    (r,) = runs["roles"]["decoupled"]
    low, high = DECOUPLED_CLIP
    loss = clipped = weights = truncated = 0.0
    tokens = sum(RESPONSE)
    for a, n in zip(ADVANTAGE, RESPONSE):
        for j in range(n):
            ratio, behaviour = PROX_RATIOS[j % 5], BEHAVIOUR_RATIOS[j % 3]
            w = min(behaviour, TIS_C)
            unclipped, clip = -a * ratio, -a * min(max(ratio, 1 - low), 1 + high)
            loss += w * max(unclipped, clip)
            clipped += clip > unclipped
            weights += w
            truncated += behaviour > TIS_C
    m = r["metrics"]
    assert m["loss"] == pytest.approx(loss / tokens, abs=1e-5)
    assert m["clip_frac"] == pytest.approx(clipped / tokens, abs=1e-6)
    assert m["rollout_tis_weight_mean"] == pytest.approx(weights / tokens, abs=1e-5)
    assert m["rollout_tis_clip_frac"] == pytest.approx(truncated / tokens, abs=1e-6)
    assert 0 < clipped < tokens and 0 < truncated < tokens  # both clips bite on some tokens, not all
    got = step_gradients(r["weights"], runs["initial"])
    assert_same_gradients(got, hf_decoupled_gradients(runs["hf_dir"]), "decoupled PPO vs transformers")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_moves_weights_and_raises_positive_advantage_log_probs(runs, layout):
    r = _last_stage(runs, layout)[0]
    before, after = r["before"]["log_probs"], r["after"]["log_probs"]
    mask = _batch(300)["response_mask"].numpy().astype(bool)
    adv = np.array(ADVANTAGE)[:, None] * mask
    pos, neg = adv > 0, adv < 0
    assert after[pos].mean() > before[pos].mean() + 1e-3, (before[pos].mean(), after[pos].mean())
    assert after[neg].mean() < before[neg].mean() - 1e-3
    m = r["metrics"]
    assert m["lr"] == pytest.approx(ACTOR_LR) and m["optimizer_steps"] == 1
    assert m["clip_frac"] == 0 and m["approx_kl"] == pytest.approx(0, abs=1e-6)  # ratio is 1 on the first step
    assert m["tokens"] == sum(PROMPT) + sum(RESPONSE) and m["tokens_per_s"] > 0
    assert math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0


def test_padding_of_the_micro_batches_is_measured(runs):
    """Sample lengths (PROMPT + RESPONSE) 12, 11, 14, 12 = 49 tokens. tp2's token budget 24 packs them first-fit
    decreasing into [14], [12, 12], [11]: 49 positions, no padding. pp2's 2 samples per micro-batch: [12, 11]
    padded to 2 x 12 and [14, 12] to 2 x 14: 52 positions, 3 of them padding."""
    tp2 = _last_stage(runs, "tp2")[0]["metrics"]
    assert tp2["padded_tokens"] == 49 and tp2["padding_frac"] == 0.0
    pp2 = _last_stage(runs, "pp2")[0]["metrics"]
    assert pp2["padded_tokens"] == 52 and pp2["padding_frac"] == pytest.approx(3 / 52)


def test_dp2_update_on_the_controllers_mini_batch_cut_equals_the_whole_batch_update(runs):
    """`update_actor`'s data plane (DP_SPLIT_MINI_BATCHES): with 2 mini-batches of 2 samples over DP=2, rank k
    receives rows k and 2+k only (worked out by hand: its part of mini-batch {0, 1}, then of {2, 3}); training on
    them (2 epochs, 4 optimizer steps) gives bit for bit the weights and metrics of the update on the whole batch on
    every rank (the RANK_ZERO path before) and the weights of one update call per hand-cut mini-batch."""
    outs = runs["roles"]["dp2_mini_batches"]
    assert sorted(o["dp_rank"] for o in outs) == [0, 1]
    for o in outs:
        k = o["dp_rank"]
        assert o["rows"] == [k, 2 + k]
        split, whole = o["split"], o["whole"]
        for path in ("whole", "by_call"):
            for name, w in o[path]["weights"].items():
                assert np.array_equal(split["weights"][name], w, equal_nan=True), (path, name)
        assert split["metrics"]["optimizer_steps"] == 4
        assert split["metrics"]["tokens"] == 2 * (sum(PROMPT) + sum(RESPONSE))  # all DP ranks, both epochs
        timing = {"time_s", "tokens_per_s"}
        assert {k: v for k, v in split["metrics"].items() if k not in timing} == {
            k: v for k, v in whole["metrics"].items() if k not in timing}
    assert not np.array_equal(outs[0]["split"]["weights"]["lm_head.weight"],
                              runs["initial"]["lm_head.weight"])  # the update moved the weights


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_update_without_old_log_probs_takes_them_from_its_forward(runs, layout):
    """One optimizer step over one mini-batch: old log-probs from the update's own forward (detached) give the same
    step as a separate forward before it (the `layout` run, itself checked against transformers above), and the
    mismatch it measures is the hand-computed one for rollout log-probs offset by a constant d = 0.1 nats."""
    separate = _last_stage(runs, layout)[0]
    fused = _last_stage(runs, f"{layout}_fused")[0]
    for name, w in fused["weights"].items():
        np.testing.assert_allclose(w, separate["weights"][name], atol=1e-6, rtol=0, err_msg=name)
    m, ref = fused["metrics"], separate["metrics"]
    assert m["old_log_probs_fused"] == 1.0 and ref["old_log_probs_fused"] == 0.0
    assert m["loss"] == pytest.approx(ref["loss"], abs=1e-6) and m["clip_frac"] == 0.0
    d = ROLLOUT_OFFSET
    assert m["mismatch_abs_diff_mean"] == pytest.approx(d, abs=1e-6)
    assert m["mismatch_abs_diff_max"] == pytest.approx(d, abs=1e-6)
    assert m["mismatch_kl"] == pytest.approx(math.exp(d) - 1 - d, abs=1e-6)  # k3 = r - 1 - log r, r = e^d
    assert m["mismatch_kl_k1"] == pytest.approx(-d, abs=1e-6)
    assert m["mismatch_ratio_out_frac"] == 0.0  # e^0.1 is inside [1/2, 2]
    # sequence ratio e^(0.1 * response length): lengths 9, 6, 12, 8 -> 0.9, 0.6, 1.2, 0.8 vs log 2 = 0.693
    assert m["mismatch_seq_ratio_out_frac"] == pytest.approx(3 / 4)


def test_reference_matches_actor_and_offload_bookkeeping(runs):
    (ref,) = runs["roles"]["reference"]
    base = _last_stage(runs, "tp1pp1")[0]
    np.testing.assert_allclose(ref["first"]["log_probs"], base["before"]["log_probs"], atol=1e-6, rtol=0)
    assert np.array_equal(ref["first"]["log_probs"], ref["second"]["log_probs"])  # offload + reload is lossless
    st = ref["offload"]
    assert st["offloaded"] == ["params"] and st["zero_bytes"]
    assert st["moved"]["params"] > 0 and st["moved"]["grads"] == 0 and st["moved"]["optimizer"] == 0
    assert "reload()" in st["run_while_offloaded"]
    trained = runs["roles"]["trained_offload"]
    assert len(trained) == 3  # dp2 (2 ranks) + tp1pp1
    for t in trained:
        assert t["same"] and all(v > 0 for v in t["moved"].values()), t
        first, second = t["staged"]
        assert first["params"] == 0 and first["grads"] == t["moved"]["grads"] > 0, t
        assert first["optimizer"] == t["moved"]["optimizer"] > 0, t
        assert second == {"params": t["moved"]["params"], "grads": 0, "optimizer": 0}, t  # the rest stays put
        assert t["params_back"] == ["grads", "optimizer"] and t["same_staged"], t


def test_critic_update_lowers_value_loss(runs):
    for r in runs["roles"]["critic"]:
        mask = _batch(300)["response_mask"].numpy().astype(bool)
        returns = np.array([1.0, -1.0, 0.5, 0.0])[:, None] * mask

        def loss(v):
            return 0.5 * ((v - returns) ** 2)[mask].mean()  # noqa: B023 (only called in this iteration)

        v0, v1 = r["v0"]["values"], r["v1"]["values"]
        assert np.all(v0[~mask] == 0)
        assert r["metrics"]["value_loss"] == pytest.approx(loss(v0), rel=1e-5)
        assert loss(v1) < loss(v0) - 1e-3, (loss(v0), loss(v1))


def test_critic_and_reward_heads_load_from_hf_and_match_transformers(runs):
    batch, out = _hf_forward(runs["rm_dir"])
    hidden = out.hidden_states[-1]  # after the final norm
    head = runs["score"]
    values = torch.nn.functional.pad((hidden @ head.T)[..., 0][:, :-1], (1, 0)) * batch["response_mask"]
    v0 = [r["v0"]["values"] for r in runs["roles"]["critic"]]
    assert len(v0) == 2
    for v in v0:
        torch.testing.assert_close(torch.from_numpy(v), values, atol=1e-5, rtol=0)
    last = batch["attention_mask"].sum(-1) - 1
    want = (hidden @ head.T)[..., 0].gather(1, last[:, None])[:, 0]
    scores = [r["scores"] for r in runs["roles"]["reward"] if r is not None]
    assert len(scores) == 1  # last pipeline stage only
    torch.testing.assert_close(torch.from_numpy(scores[0]), want, atol=1e-5, rtol=0)


def test_critic_head_saved_and_loaded_through_dist_checkpoint_at_another_layout(runs):
    trained = runs["roles"]["critic"][0]
    reloaded = [r for r in runs["roles"]["critic_reloaded"] if r is not None]
    assert len(reloaded) == 1
    np.testing.assert_allclose(reloaded[0]["values"], trained["v1"]["values"], atol=1e-5, rtol=0)
    assert not np.allclose(trained["v1"]["values"], trained["v0"]["values"], atol=1e-4)  # the update is in it
    np.testing.assert_allclose(trained["head"]["score.weight"], runs["score"].numpy(), atol=1e-2)


def test_sft_loss_is_response_cross_entropy_and_falls(runs):
    losses = runs["roles"]["sft"]  # one rank; the fixture flattens per-rank lists
    assert len(losses) == 3
    mask = _batch(300)["response_mask"].bool()
    want = -_hf_token_log_probs(runs)[mask].mean().item()
    assert losses[0] == pytest.approx(want, abs=1e-5)
    assert losses[2] < losses[1] < losses[0], losses
