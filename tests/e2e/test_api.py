"""The README's Python API example, executed as a user runs it (`python examples/api_quickstart.py` from the repo
root): Ray, two worker processes, vLLM TP=2, three GRPO steps driven by `trainer.step()` then `trainer.fit()`,
`generate`, `export_hf`.

What it is compared with, none of it computed by the API:
- the README block is the example file, character for character (so the README cannot rot silently);
- the reward curve equals the first 3 steps of the CLI's run of the same config (the session's shared
  `quickstart_run`, `megarl train yaml_configs/cpu_quickstart.yaml` on this machine, tests/e2e/conftest.py): the
  example's closure reward is the quickstart's rule (every record has the same target words) and its records are the
  quickstart's file, so the API must run the CLI's engine step for step -- bit for bit, on the same host;
- `generate`'s greedy text equals transformers' greedy decoding of the exported HuggingFace model (the weights after
  step 3, read back by transformers itself).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT
from tests.subprocess_env import clean_env

EXAMPLE = os.path.join(ROOT, "examples", "api_quickstart.py")
RUN_DIR_IN_EXAMPLE = "runs/api_quickstart"


def readme_example() -> str:
    """The ```python block of README.md's "## The Python API" section."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## The Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_api_example_runs_the_cli_engine(tmp_path, quickstart_run):
    code = readme_example()
    assert code == open(EXAMPLE).read(), "README's API example and examples/api_quickstart.py differ"
    assert code.count(RUN_DIR_IN_EXAMPLE) >= 2
    script = tmp_path / "api_quickstart.py"
    script.write_text(code.replace(RUN_DIR_IN_EXAMPLE, str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    cli = [r["reward/mean"] for r in quickstart_run.rows[:3]]
    got = [r["reward/mean"] for r in rows]
    assert got == cli, (got, cli)
    # step() returned the row metrics.jsonl holds for step 1
    assert f"step 1: reward {rows[0]['reward/mean']:.3f} kl {rows[0]['actor/kl']:.4f}" in proc.stdout
    assert "run summary: steps 1..3 of 3" in proc.stdout  # fit() ended with the table and the plots
    assert os.path.getsize(tmp_path / "run" / "plots" / "reward.png") > 0

    generated = json.loads(re.search(r"^generated: (.*)$", proc.stdout, re.M).group(1))
    hf_dir = re.search(r"^exported: (.*)$", proc.stdout, re.M).group(1)
    assert hf_dir == str(tmp_path / "run" / "hf")
    assert len(generated) == 1 and isinstance(generated[0], str)
    prompt = json.loads(open(os.path.join(ROOT, "data", "quickstart", "train.jsonl")).readline())["prompt"]
    assert generated[0] == _transformers_greedy(hf_dir, prompt, max_new_tokens=32)


def _transformers_greedy(hf_dir: str, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=True)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True).strip()
