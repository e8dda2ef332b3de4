"""The Megatron roles on a multi-turn batch (2 gloo ranks, actor and critic at TP=2, fp32): the loss mask has a gap
of tool tokens between two sampled spans, and the roles read the mask, not a span.

- The actor's log-probs of the sampled tokens on both sides of the gap match transformers' (the tool tokens are fed
  through the model and condition what follows), and are 0 on the tool tokens; the critic's values are 0 there.
- A PPO update whose batch holds garbage advantages and old log-probs on the tool tokens gives bit for bit the
  weights and metrics of the same update with zeros there: no context token reaches the loss or its normaliser.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megarl.platform.spawn import run_ranks

GARBAGE = 1000.0


def _batch():
    from megarl.data.trajectory import TrajectoryBuilder, trajectories_to_batch

    multi = (TrajectoryBuilder([5, 17, 9, 30], uid="a", group_uid="q")
             .sampled([41, 12, 7], [-1.0, -2.0, -3.0], policy_version=0)
             .context([100, 101, 102])  # a tool's output: conditions the next turn, never trained
             .sampled([55, 2], [-1.5, -0.5], policy_version=0).build("stop"))
    single = (TrajectoryBuilder([5, 8, 3], uid="b", group_uid="q")
              .sampled([61, 62, 63, 2], [-1.0, -1.0, -1.0, -1.0], policy_version=0).build("stop"))
    return trajectories_to_batch([multi, single])


def _params(role) -> list[np.ndarray]:
    return [p.detach().clone().numpy() for p in role.engine.module.parameters()]


def _worker(rank: int, world: int, hf_dir: str):
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.roles import Actor, BatchingSettings, Critic, OptimizerSettings

    spec = ModelSpec.from_hf_dir(hf_dir)
    batch = _batch()
    mask = batch["loss_mask"]
    context = (1 - mask) * batch["attention_mask"]  # prompt and tool tokens
    opt = OptimizerSettings(lr=1e-2, clip_grad=1.0)
    groups = build_role_groups(RoleTopology(tp=2))
    batching = BatchingSettings(micro_batch_samples=1)
    res = {}
    updates = {}
    for name, fill in (("clean", 0.0), ("garbage", GARBAGE)):
        actor = Actor(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir)
        lp = actor.compute_log_probs(batch)
        if name == "clean":
            res["log_probs"], res["entropy"] = lp["log_probs"].numpy(), lp["entropy"].numpy()
        adv = torch.tensor([[1.0], [-0.5]]) * mask + fill * context
        old = lp["log_probs"] + (fill / 100) * context  # 0 on context in the clean run, 10 nats in the other
        metrics = actor.update(batch.update({"advantages": adv, "old_log_probs": old}))
        updates[name] = {"params": _params(actor), "metrics": metrics}
    res["same_params"] = all(np.array_equal(a, b) for a, b in zip(updates["clean"]["params"],
                                                                   updates["garbage"]["params"]))
    res["moved"] = any(not np.array_equal(a, b) for a, b in zip(updates["clean"]["params"], _params(Actor(
        spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir))))
    drop = ("time_s", "tokens_per_s")
    res["metrics"] = {k: {n: v for n, v in u["metrics"].items() if n not in drop} for k, u in updates.items()}
    critic = Critic(spec, groups, optimizer=opt, batching=batching, hf_dir=hf_dir)
    res["values"] = critic.compute_values(batch)["values"].numpy()
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.checkpoint.tiny import make_hf_model

    hf_dir = make_hf_model("llama", str(tmp_path_factory.mktemp("hf") / "llama"), seed=5)
    return {"ranks": run_ranks(2, _worker, hf_dir, timeout_s=600), "hf_dir": hf_dir}


def test_actor_log_probs_across_the_tool_gap_match_transformers(runs):
    from transformers import AutoModelForCausalLM

    batch = _batch()
    model = AutoModelForCausalLM.from_pretrained(runs["hf_dir"], attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    want = torch.zeros(batch["input_ids"].shape)
    want[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    want = want * batch["loss_mask"]
    mask = batch["loss_mask"].bool().numpy()
    for r in runs["ranks"]:
        got = r["log_probs"]
        assert np.all(got[~mask] == 0) and np.all(r["entropy"][~mask] == 0)
        np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
        assert np.all(r["values"][~mask] == 0) and np.all(r["values"][mask] != 0)


def test_garbage_on_context_tokens_never_reaches_the_update(runs):
    for r in runs["ranks"]:
        assert r["moved"], "the update did not move the weights"
        assert r["same_params"], "advantages / old log-probs on context tokens changed the update"
        assert r["metrics"]["clean"] == r["metrics"]["garbage"]
