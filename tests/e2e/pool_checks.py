"""Checks the rollout-pool e2e tests share (tests/e2e/test_rollout_pool.py, test_rollout_pool_layouts.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.conftest import ROOT


def greedy_validation_reward(step_dir, cfg: dict) -> float:
    """The validation reward (mean of the config's validation prompts' `token_fraction` rewards) of transformers'
    greedy decoding, on the HF export (`megarl export`) of the checkpoint at `step_dir`: what a run's greedy
    `val/reward_mean` after that step's sync must equal. `cfg` is the run's config as a mapping (absolute data and
    tokenizer paths)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenization import PromptEncoder
    from megarl.rewards import token_fraction

    hf_dir = step_dir.parent.parent / f"hf_{step_dir.name}"
    proc = subprocess.run([sys.executable, "-m", "megarl", "export", str(step_dir), "--out", str(hf_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    encoder = PromptEncoder(cfg["model"]["tokenizer"], cfg["data"]["chat_template"])
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    eos = encoder.eos_token_id
    scores = []
    for line in open(cfg["data"]["val_path"]):
        record = json.loads(line)
        ids = torch.tensor([encoder.encode(record["prompt"])])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=cfg["rollout"]["max_new_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        scores.append(token_fraction(encoder.decode(out[0, ids.shape[1]:].tolist()), record["answer"], record))
    return float(torch.tensor(scores, dtype=torch.float32).mean())
