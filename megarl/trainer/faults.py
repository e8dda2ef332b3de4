"""Errors that end a run on purpose, with a one-line reason (the CLI prints it without a traceback, exit 1).

`RunAborted`: the trainer stopped the run because continuing would train on garbage, e.g. more than
`trainer.max_skipped_steps` optimizer steps in a row skipped for a non-finite loss or gradient norm. (Reward failures
raise `megarl.rewards.RewardError`, which the CLI reports the same way.)
"""

from __future__ import annotations


class RunAborted(RuntimeError):
    """The trainer stopped the run; the message says why and which config key bounds it."""
