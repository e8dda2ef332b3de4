"""Regenerate `tests/e2e/golden/quickstart_addition_short.<kernel class>.json`, the short `megarl quickstart` curves.

    cd <repo root> && .venv/bin/python -m tests.e2e.regenerate_golden_addition [--out PATH]

One file per CPU kernel class (`tests/e2e/golden_host.py`): this host's.

Runs `megarl quickstart` with the test's `SHORT_ARGS` in a temporary directory (the test's clean environment) and
writes, atomically: the three held-out accuracies, the SFT losses at its evaluations, the GRPO reward per step and
the machine. Only regenerate when a change is meant to alter the curves, and say so in the commit message.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tests.e2e.golden_host import golden_path, host_kernel_class
from tests.e2e.regenerate_golden import machine, write_json_atomically
from tests.e2e.test_quickstart_addition import GOLDEN_STEM, SHORT_ARGS, run_short
from tests.subprocess_env import clean_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where to write the golden JSON (default: the class's file)")
    args = parser.parse_args(argv)
    env = clean_env()
    klass = host_kernel_class()
    out = args.out or golden_path(GOLDEN_STEM, klass)
    with tempfile.TemporaryDirectory(prefix="megarl-golden-") as tmp:
        run_dir = os.path.join(tmp, "run")
        proc = run_short(run_dir, env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            sys.stderr.write(f"\nquickstart run failed (exit {proc.returncode}); {out} left unchanged\n")
            return 1
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
    golden = {
        "command": "megarl quickstart --out DIR " + " ".join(SHORT_ARGS),
        "machine": machine(),
        "kernel_class": klass,
        "accuracy_initial": summary["accuracy_initial"],
        "accuracy_after_sft": summary["accuracy_after_sft"],
        "accuracy_after_grpo": summary["accuracy_after_grpo"],
        "sft_loss": [c["loss"] for c in summary["sft_curve"]],
        "grpo_reward_mean": [round(r, 6) for r in summary["grpo_reward_mean"]],
    }
    write_json_atomically(golden, out)
    print(f"wrote {out}: accuracy after SFT {golden['accuracy_after_sft']}, after GRPO {golden['accuracy_after_grpo']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
