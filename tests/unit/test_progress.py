"""The console progress of a run (`megarl.trainer.progress`): a tqdm bar with reward, KL, step time and ETA, or one
log line per step; `auto` picks the bar only on a terminal."""

from __future__ import annotations

import io
import logging

from megarl.trainer.progress import ConsoleProgress

STEP = {"reward/mean": 0.5, "response_length/mean": 12.0, "actor/loss": -0.01, "actor/kl": 0.0123,
        "actor/approx_kl": 0.9, "actor/grad_norm": 1.0, "time/step_s": 2.0, "time/rollout_s": 1.0,
        "time/update_actor_s": 0.5}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_shows_reward_kl_step_time_and_eta():
    out = _Terminal()
    progress = ConsoleProgress(total=4, first=1, mode="auto", stream=out)
    assert progress.mode == "bar"
    progress.update(1, STEP)
    progress.update(2, {**STEP, "reward/mean": 0.75, "val/reward_mean": 1.0})
    progress.close()
    last = out.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "steps 2/4" in last
    assert "reward 0.750 kl 0.0123 2.0 s/step val 1.000" in last  # the reference KL, not approx_kl
    assert "<" in last  # tqdm's elapsed<remaining (the ETA)


def test_lines_when_not_a_terminal(caplog):
    out = io.StringIO()
    progress = ConsoleProgress(total=4, first=3, mode="auto", log_every=2, stream=out)
    assert progress.mode == "lines"
    with caplog.at_level(logging.INFO, logger="megarl.trainer"):
        progress.update(3, STEP)
        progress.update(4, {k: v for k, v in STEP.items() if k != "actor/kl"})
    progress.close()
    assert out.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [
        "step 4/4 reward 0.500 len 12.0 loss -0.0100 kl 0.9000 grad_norm 1.000 | 2.0 s (rollout 1.0, update 0.5)"]
