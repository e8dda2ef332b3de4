"""DAPO dynamic sampling through `megarl train` (yaml_configs/cpu_dapo.yaml: dynamic_sampling on, max_rounds 3).

With reward.function=exact_match the random tiny model never produces the answer (every response runs to
max_new_tokens), so every group's scores are equal (0, plus the same soft overlong penalty): the step must generate
its 3 rounds of 8 prompts, drop 16 all-equal groups, fill the batch with the first 8 (so it still holds
prompts_per_step x samples_per_prompt = 32 samples) and count them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_all_equal_groups_are_refilled_up_to_max_rounds_then_counted(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "train", "yaml_configs/cpu_dapo.yaml", "trainer.total_steps=1",
         "trainer.val_every=0", "reward.function=exact_match", f"logging.dir={tmp_path}"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    got = {k: row[k] for k in row if k.startswith("dynamic_sampling/")}
    assert got == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 16.0,
                   "dynamic_sampling/filled_groups": 8.0, "dynamic_sampling/surplus_groups": 0.0}
    assert row["samples"] == 32.0 and row["reward/max"] == row["reward/min"]
    assert "8 of 8 groups have all-equal scores after algorithm.dynamic_sampling.max_rounds=3" in proc.stderr
