"""Exact resume through `megarl train`, as a user runs it (CPU quickstart, fp32, deterministic).

For GRPO (actor + reference) and PPO (actor + reference + critic, colocated):
  uninterrupted: steps 1-4 in one run with checkpoints after steps 2 and 4 -- for GRPO the session's shared
                 `quickstart_run` (tests/e2e/conftest.py: 20 steps, a checkpoint every 2, constant LR, validation only
                 at steps 10 and 20, so its steps 1-4 are those of a 4-step run), for PPO the session's
                 `killed_worker_run` (tests/e2e/fault_runs.py: 200 steps, a checkpoint every 2, no validation,
                 constant LR, a worker killed after step 4 was logged and checkpointed: test_worker_faults.py);
  interrupted:   what a run stopped after step 2 leaves is its step-2 checkpoint, and the uninterrupted run saved
                 exactly that one (same config and seed, deterministic on one host): a copy of it is resumed with
                 trainer.total_steps=4. (A stop mid-run by a signal, and the resume of what that run saved, is
                 tests/e2e/test_stop_signal.py.) GRPO's resume saves every step and keeps the last one only
                 (checkpoint.keep_last=1: the copied step 2 and step 3 are pruned), and runs with the actor's params,
                 grads and optimizer and the reference's params offloaded to host memory between phases: on CPU that
                 is bookkeeping only, so it must change nothing (every offloaded piece of state came back).
Every per-step metric of steps 3-4 that is not a wall time or the offloaded byte count (rewards, losses, grad norms,
KL, clip fractions, mismatch, entropy, reshard bytes) must be bit-identical between the two, and so must every
tensor of the final checkpoints (weights and Adam moments of the actor and the critic, read back with
torch.distributed.checkpoint, independent of megarl), the LR schedulers' positions and the step counters. GRPO also
resumes at another actor layout: a third run loads the step-2 (TP2) checkpoint at TP1xPP2 and runs steps 3-4, saving
after step 4. Steps 3 and 4 must give the uninterrupted run's rewards, and its actor loss and grad norm within 1e-6
(float reduction order differs between layouts); step 4 follows three Adam steps taken from the resumed moments (two
optimizer steps per trainer step: prompts_per_step 8, mini_batch_prompts 4). Its step-4 checkpoint must hold the
uninterrupted run's weights and Adam moments, tensor by tensor within LAYOUT_TOL of that tensor's largest magnitude
(the checkpoint's keys and global shapes do not depend on the layout), and the same scheduler position and step
counter. The expected values always come from an uninterrupted run made in the same session on the same machine.
That PPO run is also the suite's PPO-with-a-colocated-critic run: GAE from a colocated TP2 critic (on its ranks: nothing
token-sized of it crosses the controller), every metric finite, one critic optimizer step per RL step, the critic's
weights moved by its updates (tests/e2e/critic_checks.py).
(Until 2026-12-03 each algorithm made a separate 2-step run to stop, and the offload check was a run of its own:
three `megarl train` start-ups of ~30 s that the copy of the uninterrupted run's step-2 checkpoint replaces; until
2026-12-06 PPO's uninterrupted run was a 4-step run of its own.)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.distributed.harness import read_dcp
from tests.e2e.conftest import QUICKSTART_SAVE_EVERY, assert_checkpoint_loads_without_pickle
from tests.e2e.critic_checks import assert_critic_weights_changed
from tests.e2e.fault_runs import PPO
from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT_TOL = 1e-6  # another layout: step 3's loss and grad norm, step 4's loss, Adam moments (relative)
# another layout after resumed Adam steps: step 4's grad norm and the step-4 weights (relative). Adam passes a
# gradient's reduction-order noise to a weight with gain lr / sqrt(v), large where v is small (an embedding row of a
# token seen once); measured 1.6e-6 (grad norm) and 1.4e-6 (word embeddings), the moments 6.7e-7
LAYOUT_TOL_AFTER_STEPS = 1e-5


def _train(run_dir, ckpt, *overrides, env):
    """`megarl train` of the quickstart with `overrides`, joined to the suite's shared Ray cluster (`env`:
    `joined_ray_env`, tests/ray_cluster.py); -> stdout + stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0",
         "logging.plots=false", f"logging.dir={run_dir}", f"checkpoint.dir={ckpt}",
         f"checkpoint.save_every={QUICKSTART_SAVE_EVERY}",
         *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout + proc.stderr


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _is_time(key: str) -> bool:
    return key.startswith("time/") or key.endswith("_s") or key.endswith("per_s")


def _assert_same_checkpoint(a: str, b: str, role: str) -> int:
    ta, tb = read_dcp(os.path.join(a, role)), read_dcp(os.path.join(b, role))
    assert sorted(ta) == sorted(tb)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in ta), sorted(ta)  # Adam moments are in it
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{role} {k}: max diff {(ta[k] - tb[k]).abs().max().item()}"
    _assert_same_schedule(a, b, role)
    return len(ta)


def _assert_same_schedule(a: str, b: str, role: str) -> None:
    """Same scheduler position and step counter. The schedule's length (lr_decay_steps, wd_incr_steps) follows
    trainer.total_steps (20 or 200 in the uninterrupted runs, 4 here); every rate at the position must be equal (the
    quickstart's LR is constant)."""
    sa = torch.load(os.path.join(a, role, "engine_state.pt"), weights_only=True)
    sb = torch.load(os.path.join(b, role, "engine_state.pt"), weights_only=True)
    length = {"lr_decay_steps", "wd_incr_steps"}
    assert {k: v for k, v in sa["scheduler"].items() if k not in length} == \
        {k: v for k, v in sb["scheduler"].items() if k not in length}
    assert sa["scheduler"]["num_steps"] == sb["scheduler"]["num_steps"] > 0
    assert sa["steps"] == sb["steps"] > 0


def _assert_close_checkpoint(want: str, got: str, role: str) -> None:
    """Every tensor of `got` (saved at another layout) close to `want`'s, relative to the largest magnitude of that
    tensor in `want` (Adam's exp_avg_sq is ~g^2, far below 1e-6 in absolute terms): the Adam moments within
    LAYOUT_TOL, the weights within LAYOUT_TOL_AFTER_STEPS; same keys, scheduler position and step counter."""
    ta, tb = read_dcp(os.path.join(want, role)), read_dcp(os.path.join(got, role))
    assert sorted(ta) == sorted(tb)
    moments = [k for k in ta if k.startswith(("optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."))]
    assert moments and len(moments) < len(ta), sorted(ta)
    rel = {k: ((ta[k] - tb[k]).abs().max() / ta[k].abs().max().clamp_min(1e-30)).item() for k in ta}
    worst_w = max((rel[k], k) for k in ta if k not in moments)
    worst_m = max((rel[k], k) for k in moments)
    print(f"{role} at another layout: worst relative diff of {len(ta) - len(moments)} weights {worst_w[0]:.3g} "
          f"({worst_w[1]}), of {len(moments)} Adam moments {worst_m[0]:.3g} ({worst_m[1]})")
    assert worst_w[0] <= LAYOUT_TOL_AFTER_STEPS and worst_m[0] <= LAYOUT_TOL, (worst_w, worst_m)
    _assert_same_schedule(want, got, role)


OFFLOAD = ("actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true",
           "reference.offload.params=true")
NOT_COMPARED = {"offload/actor_bytes"}  # bytes moved to host memory: > 0 with offload, 0 without


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_resume_is_bit_identical(tmp_path, algo, request, joined_ray_env):
    extra = PPO if algo == "ppo" else ()
    if algo == "grpo":
        shared = request.getfixturevalue("quickstart_run")
        full, full_ckpt = shared.rows[:4], shared.ckpt_dir
    else:  # the session's PPO run whose worker is killed after step 4 (tests/e2e/fault_runs.py)
        killed = request.getfixturevalue("killed_worker_run")
        full, full_ckpt = killed.rows[:4], killed.ckpt_dir
        _assert_ppo_ran_its_critic(full)
        assert_critic_weights_changed(full_ckpt, 2, 4)
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    assert all("checkpoint/save_s" in r for r in full if r["step"] in (2, 4))
    # the interrupted run: what a run stopped after step 2 leaves (see the module docstring)
    part_run, part_ckpt = tmp_path / "part", tmp_path / "part_ckpt"
    shutil.copytree(full_ckpt / "step_000002", part_ckpt / "step_000002")
    if algo == "grpo":
        shutil.copytree(full_ckpt / "step_000002", tmp_path / "layout_ckpt" / "step_000002")  # the layout resume
    grpo_only = ("checkpoint.save_every=1", "checkpoint.keep_last=1", *OFFLOAD) if algo == "grpo" else ()
    out = _train(part_run, part_ckpt, "trainer.total_steps=4", *extra, *grpo_only, env=joined_ray_env)
    assert f"resumed from {part_ckpt}/step_000002 (step 2 of 4" in out, out[-3000:]
    loaded = "actor+optimizer, critic+optimizer" if algo == "ppo" else "actor+optimizer"
    assert f"loaded {loaded})" in out, out[-3000:]
    if algo == "grpo":
        assert "config change since" in out and "trainer.total_steps: 20 -> 4 (neutral)" in out, out[-3000:]
        assert "actor.offload.params: False -> True (neutral)" in out, out[-3000:]
        # saved after steps 3 and 4, kept the last one only: the copied step 2 and step 3 were pruned
        assert sorted(os.listdir(part_ckpt)) == ["step_000004"]
        assert sorted(os.listdir(part_ckpt / "step_000004")) == ["actor", "controller_state.pt", "rng",
                                                                 "trainer_state.json"]
        record = json.load(open(part_ckpt / "step_000004" / "trainer_state.json"))
        assert record["step"] == 4 and record["config"]["trainer"]["total_steps"] == 4
        state = torch.load(part_ckpt / "step_000004" / "controller_state.pt", weights_only=True)
        assert state["step"] == 4 and state["states"]["loader"]["position"] > 0
        assert sorted(state["states"]) == ["kl", "loader", "loop", "rng", "schedule"]

    part = _rows(part_run)
    assert [r["step"] for r in part] == [3, 4]
    if algo == "grpo":  # the actor's state really left the device every step
        assert all(r["offload/actor_bytes"] > 0 for r in part), [r["offload/actor_bytes"] for r in part]
    compared = set()
    for a, b in zip(full[2:], part):
        keys = {k for k in a if not _is_time(k)} - NOT_COMPARED
        assert keys == {k for k in b if not _is_time(k)} - NOT_COMPARED
        for k in keys:
            assert a[k] == b[k], (a["step"], k, a[k], b[k], "resumed" + (" with offload" if algo == "grpo" else ""))
        compared |= keys
    must = {"reward/mean", "actor/loss", "actor/grad_norm", "actor/kl", "actor/approx_kl", "actor/clip_frac",
            "actor/entropy"}
    if algo == "ppo":
        must |= {"critic/value_loss", "critic/grad_norm"}
    assert must <= compared, must - compared

    final_full, final_part = full_ckpt / "step_000004", part_ckpt / "step_000004"
    for role in ("actor", "critic") if algo == "ppo" else ("actor",):
        _assert_same_checkpoint(str(final_full), str(final_part), role)
    # sync mode's checkpoint holds no pickled object (the other modes': tests/e2e/test_async_modes.py)
    roles = ("actor", "critic") if algo == "ppo" else ("actor",)
    assert_checkpoint_loads_without_pickle(final_part, must_have=(*(f"{r}/engine_state.pt" for r in roles),
                                                                  "controller_state.pt"))

    if algo == "grpo":
        _check_resume_at_another_layout(tmp_path / "layout", tmp_path / "layout_ckpt", full, str(final_full),
                                        joined_ray_env)


def _check_resume_at_another_layout(run_dir, ckpt, full: list[dict], full_final: str, env: dict) -> None:
    """Steps 3-4 at TP1xPP2 from the step-2 TP2 checkpoint in `ckpt`, saved after step 4, against the
    uninterrupted run (`full`: its metric rows; `full_final`: its step-4 checkpoint)."""
    out = _train(run_dir, ckpt, "trainer.total_steps=4", "actor.parallel.tp=1", "actor.parallel.pp=2", env=env)
    assert "actor.parallel.pp: 1 -> 2 (layout)" in out
    rows = {r["step"]: r for r in _rows(run_dir)}
    assert sorted(rows) == [3, 4]
    for step in (3, 4):
        got, want = rows[step], full[step - 1]
        print(f"step {step} at TP1xPP2: actor loss {got['actor/loss']!r} vs {want['actor/loss']!r}, grad norm "
              f"{got['actor/grad_norm']!r} vs {want['actor/grad_norm']!r}")
    _assert_close_checkpoint(full_final, os.path.join(ckpt, "step_000004"), "actor")
    for step in (3, 4):
        got, want = rows[step], full[step - 1]
        assert got["reward/mean"] == want["reward/mean"], step  # (nearly) the same weights -> the same rollout
        assert abs(got["actor/loss"] - want["actor/loss"]) <= LAYOUT_TOL, (step, got["actor/loss"], want)
        # step 3's gradient already follows one resumed Adam step (two optimizer steps per trainer step): measured
        # 9.6e-7 relative, too close to 1e-6 for another host
        tol = LAYOUT_TOL_AFTER_STEPS
        assert abs(got["actor/grad_norm"] - want["actor/grad_norm"]) <= tol * want["actor/grad_norm"], step


def _assert_ppo_ran_its_critic(rows: list[dict]) -> None:
    """PPO preset: GAE advantages from a critic (TP=2) colocated with the actor; every metric finite. GAE ran on
    the critic's ranks (`RoleHost.compute_values(gae=)`): no values came up and no advantages or returns went down,
    so generation's ids and log-probs were the step's only token-sized crossings of the controller (5 when GAE ran
    on the controller: values up, advantages and returns down)."""
    for r in rows:
        for key in ("critic/value_loss", "critic/grad_norm", "actor/loss", "reward/mean"):
            assert math.isfinite(r[key]), (key, r[key])
        assert r["critic/optimizer_steps"] == 1
        assert (r["dispatch/token_results_up"], r["dispatch/token_tensors_down"],
                r["dispatch/token_crossings"]) == (0, 0, 2), r["step"]


def test_breaking_config_change_is_refused(tmp_path, quickstart_run):
    """A resume whose config changes the algorithm is refused before any step, naming the key; nothing is lost.
    The checkpoint is a copy of the shared run's step 2."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(quickstart_run.ckpt_dir / "step_000002", ckpt / "step_000002")
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0",
         f"logging.dir={tmp_path / 'run'}", f"checkpoint.dir={ckpt}", "trainer.total_steps=3",
         "algorithm.clip_low=0.1"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "algorithm.clip_low: 0.2 -> 0.1" in proc.stderr and "checkpoint.allow_config_change=true" in proc.stderr
    assert sorted(os.listdir(ckpt)) == ["step_000002"]
