"""A non-finite loss or gradient norm skips the optimizer step (2 gloo ranks, real megatron-core, fp32).

megatron-core 0.16.1 only checks for inf/nan through the fp16 grad scaler; in fp32 its `optimizer.step()` would write
NaN into every weight. `MegatronEngine.step` checks the global grad norm (and the loss) itself. Per layout (TP=2 on
ranks 0-1, then PP=2 on ranks 0-1), from the same tiny HF model:
  1. an actor update whose advantages hold one NaN (sample 0, its first response token): skipped -- weights, Adam
     moments, the engine's step count and the LR schedule unchanged; `skipped_steps` = 1;
  2. the same update with finite advantages: applied, the weights move;
  3. NaN again after that: skipped, weights and Adam moments equal to those after step 2 (bit for bit);
  4. the engine alone, a loss that is finite (0) with a NaN gradient (sqrt(|x|) at x = 0 has derivative
     inf * 0 = nan): skipped with skip_reason 'grad_norm', weights unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import response_batch

PROMPTS = [[3, 5, 7], [4, 6], [8, 9, 10, 11], [12, 13]]
RESPONSES = [[20, 21, 22, 23], [24, 25, 26], [27, 28], [29, 30, 31, 32, 33]]
ADVANTAGE = [1.0, -1.0, 0.5, -0.5]


def _params(role) -> list[torch.Tensor]:
    return [p.detach().clone() for p in role.engine.module.parameters()]


def _adam_moments(role) -> list[torch.Tensor]:
    opt = role.engine.optimizer
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    return [v.detach().clone() for o in inner for st in o.state.values() for k, v in sorted(st.items())
            if k in ("exp_avg", "exp_avg_sq")]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _worker(rank: int, world: int, hf_dir: str):
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.roles import Actor, BatchingSettings, OptimizerSettings

    spec = ModelSpec.from_hf_dir(hf_dir)
    batch = response_batch(PROMPTS, RESPONSES)
    mask = batch["response_mask"]
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * mask.float()
    nan_adv = adv.clone()
    nan_adv[0, len(PROMPTS[0])] = math.nan
    out = {}
    for name, topo in (("tp2", RoleTopology(tp=2)), ("pp2", RoleTopology(pp=2))):
        groups = build_role_groups(topo)
        actor = Actor(spec, groups, optimizer=OptimizerSettings(lr=1e-3, clip_grad=1.0), hf_dir=hf_dir,
                      batching=BatchingSettings(micro_batch_samples=2))
        lp = actor.compute_log_probs(batch)
        old = lp["log_probs"] if lp is not None else torch.zeros(mask.shape)
        # PP: only the last stage gets the log-probs; every stage needs the same batch
        torch.distributed.broadcast(old, src=1 if topo.pp == 2 else 0)
        w0 = _params(actor)
        m1 = actor.update(batch.update({"old_log_probs": old, "advantages": nan_adv}))
        w1, s1 = _params(actor), actor.engine.steps
        m2 = actor.update(batch.update({"old_log_probs": old, "advantages": adv}))
        w2, a2, s2 = _params(actor), _adam_moments(actor), actor.engine.steps
        m3 = actor.update(batch.update({"old_log_probs": old, "advantages": nan_adv}))
        w3, a3 = _params(actor), _adam_moments(actor)

        engine = actor.engine

        def nan_grad_loss(logits, mb):
            loss = (logits.sum() * 0.0).abs().sqrt()  # value 0; d/dx sqrt(|x|) at 0 = inf * 0 = nan
            units = torch.tensor(1, dtype=torch.int)
            return loss, units, {"loss_sum": loss.detach(), "units": units}

        ids = batch["input_ids"]
        engine.run([{"input_ids": ids}], nan_grad_loss, forward_only=False)
        st4 = engine.step()
        w4 = _params(actor)
        out[name] = {
            "m1": m1, "m2": m2, "m3": m3, "steps": (s1, s2, engine.steps),
            "w_unchanged_1": _same(w0, w1), "w_moved_2": not _same(w1, w2), "w_unchanged_3": _same(w2, w3),
            "adam_unchanged_3": _same(a2, a3) and len(a2) > 0, "w_unchanged_4": _same(w3, w4), "st4": st4,
            "finite_2": all(bool(torch.isfinite(p).all()) for p in w2),
            "lr_steps": actor.engine.scheduler.num_steps,
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.distributed.harness import tiny_qwen2_dir

    return run_ranks(2, _worker, tiny_qwen2_dir(tmp_path_factory), timeout_s=400)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_nan_advantage_skips_the_step_and_keeps_the_weights(runs, layout):
    for rank, res in enumerate(runs):
        r = res[layout]
        assert r["m1"]["skipped_steps"] == 1.0 and r["m1"]["skipped_trailing"] == 1.0, (rank, r["m1"])
        assert math.isnan(r["m1"]["loss"]), r["m1"]
        assert r["w_unchanged_1"], rank
        assert r["m2"]["skipped_steps"] == 0.0 and r["m2"]["skipped_trailing"] == 0.0
        assert math.isfinite(r["m2"]["grad_norm"]) and r["m2"]["grad_norm"] > 0
        assert r["w_moved_2"] and r["finite_2"], rank
        assert r["m3"]["skipped_steps"] == 1.0
        assert r["w_unchanged_3"] and r["adam_unchanged_3"], rank
        # one applied step: the engine and the LR schedule advanced once, the skipped ones did not count
        assert r["steps"] == (0, 1, 1) and r["lr_steps"] == 1, r["steps"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_finite_loss_with_nan_gradient_is_skipped(runs, layout):
    for res in runs:
        st = res[layout]["st4"]
        assert st["update_applied"] is False and st["skip_reason"] == "grad_norm", st
        assert math.isnan(st["grad_norm"])
        assert res[layout]["w_unchanged_4"]
