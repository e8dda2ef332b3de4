"""What the console shows while a run trains: a progress bar over steps, or one line per logged step.

`logging.progress`: `bar` = a tqdm bar on stderr over `trainer.total_steps` with the last step's reward, KL and
step time in its postfix and tqdm's ETA; `lines` = one `step N/T reward ... | s (rollout, update)` log line every
`trainer.log_every` steps (what log files and CI want); `auto` = the bar when stderr is a terminal, else lines.
Every metric of every step goes to `<logging.dir>/metrics.jsonl` either way (`RLLoop._log`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import IO, Optional

logger = logging.getLogger("megarl.trainer")


def kl_of(m: dict[str, float]) -> float:
    """The KL shown to the user: against the reference when there is one (`actor/kl`), else the policy's
    approximate KL to the old policy (`actor/approx_kl`); NaN when neither was logged."""
    return m.get("actor/kl", m.get("actor/approx_kl", float("nan")))


def step_line(step: int, total: int, m: dict[str, float]) -> str:
    """The one-line summary of a step (lines mode, and the end-of-run table's source of truth for its columns)."""
    return (f"step {step}/{total} reward {m['reward/mean']:.3f} len {m['response_length/mean']:.1f} "
            f"loss {m.get('actor/loss', math.nan):.4f} kl {kl_of(m):.4f} "
            f"grad_norm {m.get('actor/grad_norm', math.nan):.3f}"
            f" | {m['time/step_s']:.1f} s (rollout {m.get('time/rollout_s', math.nan):.1f}, "
            f"update {m.get('time/update_actor_s', math.nan):.1f})")


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class ConsoleProgress:
    """`update(step, metrics)` after each step; `close()` at the end (idempotent)."""

    def __init__(self, total: int, first: int, mode: str = "auto", log_every: int = 1,
                 stream: Optional[IO[str]] = None) -> None:
        self.total, self.log_every = total, max(1, log_every)
        stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
        self.mode = mode
        self.bar = None
        self._redirect = None
        if mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # log lines (warnings, checkpoints) are printed above the bar instead of breaking it
            self._redirect = logging_redirect_tqdm(loggers=[logging.root])
            self._redirect.__enter__()
            width = _columns(stream)  # a terminal that reports 0 columns (a bare pty) would get an empty bar
            self.bar = tqdm(total=total, initial=first - 1, desc="steps", unit="step", file=stream,
                            dynamic_ncols=width > 0, ncols=None if width > 0 else 100, nrows=None if width > 0 else 24,
                            bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")

    def update(self, step: int, m: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"reward {m['reward/mean']:.3f} kl {kl_of(m):.4f} {m['time/step_s']:.1f} s/step"
                                     + (f" val {m['val/reward_mean']:.3f}" if "val/reward_mean" in m else ""),
                                     refresh=False)
            self.bar.update(1)
        elif step % self.log_every == 0:
            logger.info(step_line(step, self.total, m))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
