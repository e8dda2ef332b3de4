"""SIGTERM / SIGINT on a real `megarl train` run (the CPU quickstart as a subprocess: Ray, 2 worker processes, vLLM
TP=2, checkpoint.dir set; in bf16 with TIS and REINFORCE++: the session's `signal_runs`, tests/e2e/fault_runs.py,
whose first 4 steps are also test_rollout_correction.py's run), as Slurm's warning signal and a terminal's Ctrl-C
deliver them:

- SIGTERM to the controller alone (what `launch/slurm_ray.sbatch` forwards): the step in flight finishes, a
  complete checkpoint of it is saved, the run exits 0 within a bound and prints the command that resumes it; that
  command (with one more step) resumes from the checkpoint and runs exactly the next step.
- SIGINT to the whole process group (Ctrl-C in a terminal reaches the Ray workers too), sent to that resumed run
  once it finished a step of its own: the same clean stop, no worker dies of it, and no process of the run is left.
The signal-to-exit time is printed (pytest -s).
"""

from __future__ import annotations

import re
import shlex
import signal

import psutil

from tests.e2e.fault_runs import STEPS_BEFORE_FAULT, alive

EXIT_DEADLINE_S = 90.0  # one quickstart step (a few seconds) + a save + shutting Ray down, with room for a busy host


def _assert_clean_stop(run, sig, ckpt, first: int) -> tuple[int, str]:
    """The stop of `run` (fault_runs.SignalledRun) after a signal: exit 0 in time, steps 1.. logged in order up to
    one >= `first`, no worker died, the last finished step checkpointed and nothing later, the resume command
    printed, no process of the run left. -> (the last step, the printed resume command)."""
    rc, out, signal_to_exit, args, rows = run.rc, run.out, run.signal_to_exit, run.args, run.rows
    print(f"\n{signal.Signals(sig).name}: signal-to-exit {signal_to_exit:.1f} s, {len(rows)} step(s) logged")
    assert rc == 0, out[-3000:]
    assert signal_to_exit < EXIT_DEADLINE_S, signal_to_exit
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1)) and first <= last < 50
    assert not re.search(r"of 2 died|KeyboardInterrupt|megarl: error", out), out[-3000:]  # no worker died of it
    assert run.complete_steps[-1] == last  # the finished step is checkpointed, and nothing later
    assert "checkpoint/save_s" in rows[-1] or f"saved checkpoint {ckpt}/step_{last:06d}" in out
    name = signal.Signals(sig).name
    expected = shlex.join([*args, "checkpoint.resume=true"] if "checkpoint.resume=true" not in args else args)
    m = re.search(rf"stopped by {name} after step {last} of 50; checkpoint {ckpt}/step_{last:06d} holds step "
                  rf"{last}\. To resume: (.+)$", out, re.M)
    assert m and m.group(1) == expected, out[-3000:]
    assert not run.left, [(p, psutil.Process(p).cmdline()[:3]) for p in alive(run.left)]  # 15 s after the exit
    return last, m.group(1)


def test_sigterm_stops_after_the_step_and_the_resumed_run_stops_on_ctrl_c(signal_runs):
    """SIGTERM to the controller of a fresh run once it logged 4 steps, then the printed resume command run as printed
    (50 steps), which continues at the next step and is stopped by Ctrl-C to its whole process group once it has run a
    step of its own. (Until 2026-12-03 the Ctrl-C case was a third run of its own, ~30 s of start-up.)"""
    ckpt, first, second = signal_runs["ckpt"], signal_runs["sigterm"], signal_runs["ctrl_c"]
    args = first.args
    assert args[:3] == ["megarl", "train", "yaml_configs/cpu_quickstart.yaml"] and f"checkpoint.dir={ckpt}" in args
    last, resume = _assert_clean_stop(first, signal.SIGTERM, ckpt, first=STEPS_BEFORE_FAULT)
    assert first.complete_steps == [last]

    # the printed command resumes the run where it stopped; Ctrl-C once it has finished a step of its own
    resume_args = shlex.split(resume)
    assert resume_args == [*args, "checkpoint.resume=true"]
    assert second is not None and second.args == resume_args
    assert f"resumed from {ckpt}/step_{last:06d} (step {last} of 50" in second.out, second.out[-3000:]
    last2, _ = _assert_clean_stop(second, signal.SIGINT, ckpt, first=last + 1)
    assert second.complete_steps == [last, last2]
