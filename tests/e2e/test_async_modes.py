"""trainer.mode one_step_off and async with real engines: the rollout-pool quickstart (actor TP2 on 2 processes, two
vLLM TP1 engines on 2 more, `yaml_configs/cpu_quickstart_rollout_pool.yaml`) and the colocated quickstart (2
processes) in one_step_off, run by the same driver.

The pool runs share one `TrainingSession` with the synchronous run of `tests/e2e/test_rollout_pool.py` (the
`pool_runs` fixture, `tests/e2e/async_runs.py`): its four workers and engines start once (~30 s here) and each run
starts from the same step-0 checkpoint, so this module costs the runs' 66 steps (~0.7 s each on this 2-core machine;
the partial-rollout run's 3 steps ~3 s each, its engines slowed so that pushes land mid-request) plus the colocated
CLI run's 18 steps (~15 s; its start-up overlaps the session's push probe and close). The lengths are what the
checks need (`tests/e2e/async_runs.py` says why each): the rewards of this task only rise after ~10 steps, those of
max_staleness 4 ~5 steps later.

What each check compares with, not from the schedules' own description:
- learning: the reward of the last 5 steps vs the first 5, the bar of the synchronous tests (+0.2);
- one_step_off resume: the run resumed from its step-15 checkpoint against the uninterrupted run, every metric but
  times (losses, grad norms, rewards, mismatch) and the final weights, bit for bit;
- async resume: the batches in the step-19 checkpoint's buffer file (read here with torch.load) are the ones the
  resumed run trains first, and over both runs every batch number 1..24 is trained exactly once (nothing lost,
  nothing counted twice);
- partial rollouts: tokens of one response sampled by two versions; for the tokens of each version the engine's
  log-probs against Megatron's recomputation with the weights being updated: tokens of those very weights agree to
  float noise, tokens of the version before differ by a real KL: the log-probs of each part are the engine's that
  sampled it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.e2e.conftest import assert_checkpoint_loads_without_pickle, read_rows

# what a resumed run may log differently: wall times (seconds, "_s") and rates, and the resume's own counts
# dispatch/: how the step's batch reached the ranks -- a batch restored from the checkpoint has no references to the
# rollout's completions (not saved) and goes down by value, the uninterrupted run's by reference: the same rows
NOT_REPEATED = ("time/", "per_s", "busy_frac", "async/restored_batches", "async/buffer", "dispatch/")


@pytest.fixture(scope="module")
def runs(pool_runs):
    return pool_runs


def _rewards(rows) -> tuple[float, float]:
    r = [row["reward/mean"] for row in rows]
    return sum(r[:5]) / 5, sum(r[-5:]) / 5


def _assert_within_the_bound(rows, bound: int) -> None:
    for row in rows:
        lags = {int(k.rsplit("/", 1)[1]): v for k, v in row.items() if k.startswith("async/lag_frac/")}
        assert abs(sum(lags.values()) - 1) < 1e-9 and max(lags) <= bound and row["async/staleness_max"] <= bound
        assert row["async/version"] == row["step"] - 1 - max(lags)
    assert max(row["async/staleness_max"] for row in rows) == bound  # the rollout ran ahead as far as allowed


# async at max_staleness 1: its bound on the "continue" run (test_partial_rollouts_...), its learning here through
# one_step_off, which trains step for step what it trains (tests/e2e/async_runs.py)
@pytest.mark.parametrize("run,bound", [("one_step_off", 1), ("async4", 4)])
def test_the_quickstart_learns_off_policy_within_the_staleness_bound(runs, run, bound):
    rows = runs["rows"][run]
    first, last = _rewards(rows)
    print(f"{run}: first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.2, [round(r["reward/mean"], 3) for r in rows]
    _assert_within_the_bound(rows, bound)


def test_one_step_off_resume_repeats_the_uninterrupted_run_bit_for_bit(runs):
    from tests.distributed.harness import read_dcp

    full = {r["step"]: r for r in runs["rows"]["one_step_off"]}
    resumed = runs["rows"]["one_step_off_resumed"]
    assert [r["step"] for r in resumed] == list(range(16, 19))
    assert resumed[0]["async/restored_batches"] == 1  # step 16's batch came from the checkpoint, generated on v14
    # ... and its rows crossed once (no rollout references after a restore: each piece's ids, log-probs and loss masks
    # put by the controller as one object, `TokenRowSource.from_rows`; 4 keys by value before) where the uninterrupted
    # run built them on the ranks from the rollout's completions: every metric below and the weights equal, so the
    # two paths train alike
    assert resumed[0]["dispatch/token_tensors_down"] == 1 and resumed[0]["dispatch/batch_pieces_by_reference"] == 0
    assert resumed[0]["dispatch/token_rows_packed_pieces"] > 0 and full[16]["dispatch/token_rows_packed_pieces"] == 0
    assert full[16]["dispatch/token_tensors_down"] == 0 and full[16]["dispatch/batch_pieces_by_reference"] > 0
    for row in resumed:
        for key, value in row.items():
            if not key.endswith("_s") and not any(part in key for part in NOT_REPEATED):
                assert full[row["step"]][key] == value, (row["step"], key)
    a = read_dcp(os.path.join(runs["out"], "one_step_off", "ckpt", "step_000018", "actor"))
    b = read_dcp(os.path.join(runs["out"], "one_step_off_resumed", "ckpt", "step_000018", "actor"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_async_resume_trains_every_finished_batch_once(runs):
    saved = torch.load(os.path.join(runs["out"], "async4", "ckpt", "step_000019", "controller_state.pt"),
                       weights_only=True)
    in_buffer = [b["index"] for b in saved["states"]["schedule"]["batches"]]
    # finished batches waiting at the save (up to max_staleness + 1 = 5: how many depends on how far the driver ran
    # ahead on this machine); nothing was in flight
    assert 1 <= len(in_buffer) <= 5, in_buffer
    first = [r for r in runs["rows"]["async4"] if r["step"] <= 19]
    resumed = runs["rows"]["async4_resumed"]
    assert [r["step"] for r in resumed] == list(range(20, 25))
    assert [int(r["async/batch_index"]) for r in resumed[:len(in_buffer)]] == in_buffer
    assert resumed[0]["async/restored_batches"] == len(in_buffer)
    trained = [int(r["async/batch_index"]) for r in first + resumed]
    assert sorted(trained) == list(range(1, 25))  # none lost, none trained twice
    for r in resumed:  # the bound holds after the resume too (the engines got version 19 at the start)
        assert r["async/staleness_max"] <= 4 and r["async/engine_version"] >= 19


def test_partial_rollouts_carry_both_versions_with_each_parts_engine_log_probs(runs):
    rows = runs["rows"]["continue"]
    mixed = [r for r in rows if "mismatch/lag0/kl" in r and "mismatch/lag1/kl" in r]
    assert mixed, [{k: v for k, v in r.items() if "lag" in k} for r in rows]
    assert rows[-1]["async/continued_requests"] > 0  # requests were in the engines across a push
    _assert_within_the_bound(rows, 1)  # async mode's bound 1 on real engines, partial responses included
    for r in mixed:
        assert 0 < r["async/lag_frac/0"] < 1 and r["async/staleness_max"] <= 1
        # version step-1's tokens: the engine held the weights Megatron recomputes with (float noise only); the
        # older version's tokens: one real update apart
        assert r["mismatch/lag0/kl"] < r["mismatch/lag1/kl"] / 10, r
    print("partial rollouts: lag0 vs lag1 KL", [(r["mismatch/lag0/kl"], r["mismatch/lag1/kl"]) for r in mixed])


def test_colocated_one_step_off_learns(runs):
    """The hybrid engine (2 processes, engines in the actor's) in one_step_off: the next batch's generation is queued
    on the same processes before this step's forwards, so only the controller's own work overlaps it on CPU.
    `megarl train yaml_configs/cpu_quickstart.yaml trainer.mode=one_step_off ...`, 18 steps, run by the pool runs'
    driver (`tests/e2e/async_runs.py`: COLOCATED, started before its push probe so that their waits overlap)."""
    report = json.load(open(runs["out"] / "runs.json"))["_colocated"]
    log = (runs["out"] / "colocated.log").read_text()
    assert report["returncode"] == 0, log[-8000:]
    rows = read_rows(runs["out"] / "colocated")
    assert [r["step"] for r in rows] == list(range(1, 19))
    first, last = _rewards(rows)
    print(f"colocated one_step_off: first 5 steps {first:.3f}, last 5 {last:.3f} ({report['seconds']:.1f} s)")
    assert last > first + 0.2
    assert [r["async/staleness_max"] for r in rows] == [0.0] + [1.0] * (len(rows) - 1)


def test_every_modes_checkpoint_loads_with_weights_only(runs):
    """one_step_off's and async's step checkpoints (the actor's distributed checkpoint and optimizer state, each
    worker's RNG state, the controller's states with the rollout buffer) hold no pickled object: each *.pt loads
    with weights_only=True (sync mode's: tests/e2e/test_resume.py)."""
    for run, step in (("one_step_off", 15), ("async4", 19)):
        checked = assert_checkpoint_loads_without_pickle(
            os.path.join(runs["out"], run, "ckpt", f"step_{step:06d}"),
            must_have=("controller_state.pt", "actor/engine_state.pt"))
        print(run, checked)
