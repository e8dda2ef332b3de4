"""The rollout engines on a pool of their own: `megarl train yaml_configs/cpu_quickstart_rollout_pool.yaml` (actor
TP2 + reference on pool "train", two vLLM TP1 engines on pool "rollout", a gloo bridge between them), a few steps,
joined to the suite's shared Ray cluster (`joined_ray_env`).

What it is compared with, none of it from the planner or the run's own description:
- every rollout rank receives, at every sync, exactly its shard: a TP1 engine holds the whole model, so the bytes of
  the HF model in fp32, counted here from transformers' own parameter shapes of the config's architecture;
- the bytes the two actor ranks send add up to the two engines' shards, and are balanced by this theory: under
  Megatron TP2 every tensor except the RMS norms is split between the two ranks (each the only holder of its half,
  which it must send to each engine itself); the norms (2 per layer + the final one, `hidden_size` fp32 each) are
  held by both, and each goes from the less-loaded rank, so the two ranks differ by at most one norm (hidden x 4 B);
- every sync is verified: each rollout rank checked every piece the plan routes into it against its sender's
  checksum;
- greedy after the last sync: the validation at the last step (greedy, through the rollout pool's engines) scores
  exactly what transformers' greedy decoding of the exported checkpoint of that step scores, prompt by prompt
  summed into the same mean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import ROOT

CONFIG = os.path.join(ROOT, "yaml_configs", "cpu_quickstart_rollout_pool.yaml")
STEPS = 3  # the sync and the greedy check need few steps; rewards on this task only rise after ~10 (see the report)


@pytest.fixture(scope="module")
def pool_run(tmp_path_factory, joined_ray_env):
    import yaml

    tmp = tmp_path_factory.mktemp("rollout_pool")
    cfg = yaml.safe_load(open(CONFIG))
    cfg["trainer"].update(total_steps=STEPS, val_every=STEPS)
    for key in ("train_path", "val_path"):
        cfg["data"][key] = os.path.join(ROOT, cfg["data"][key])
    cfg["model"]["tokenizer"] = os.path.join(ROOT, cfg["model"]["tokenizer"])
    cfg["checkpoint"] = {"dir": str(tmp / "ckpt")}  # saved at the last step: the weights of the last sync
    config = tmp / "pool.yaml"
    config.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megarl", "train", str(config), f"logging.dir={tmp / 'run'}"],
                          cwd=ROOT, env=joined_ray_env, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in open(tmp / "run" / "metrics.jsonl")]
    print(f"rollout-pool run: {STEPS} steps in {seconds:.1f} s")
    return {"proc": proc, "rows": rows, "cfg": cfg, "tmp": tmp}


def _model_bytes(arch: dict) -> tuple[int, int]:
    """(bytes of the HF model in fp32, hidden_size) from transformers' own module of the architecture."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
                     intermediate_size=arch["ffn_hidden_size"], num_hidden_layers=arch["num_layers"],
                     num_attention_heads=arch["num_attention_heads"], num_key_value_heads=arch["num_query_groups"],
                     head_dim=arch["head_dim"], max_position_embeddings=arch["max_position_embeddings"],
                     tie_word_embeddings=arch["tie_word_embeddings"])
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    return sum(p.numel() for p in model.parameters()) * 4, arch["hidden_size"]


def test_every_rollout_rank_receives_exactly_its_shard_and_the_senders_are_balanced(pool_run):
    rows, arch = pool_run["rows"], pool_run["cfg"]["model"]["arch"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    model, hidden = _model_bytes(arch)
    for r in rows:
        received = [r[f"reshard/pool/received_bytes_rank{i}"] for i in (0, 1)]
        assert received == [model, model], (r["step"], received, model)
        sent = [r[f"reshard/pool/sent_bytes_rank{i}"] for i in (0, 1)]
        assert sum(sent) == 2 * model, (r["step"], sent, model)
        assert abs(sent[0] - sent[1]) <= hidden * 4, (r["step"], sent)
        assert r["reshard/pool/sent_max_bytes"] / r["reshard/pool/sent_mean_bytes"] <= 1 + hidden * 4 / (2 * model)
        assert r["reshard/pool/lower_bound_bytes"] == 2 * model  # a rollout rank holds nothing: all of it is moved
    print(f"per sync: each rollout rank received {model} B; actor ranks sent {sent} B "
          f"(max/mean {rows[-1]['reshard/pool/sent_max_bytes'] / rows[-1]['reshard/pool/sent_mean_bytes']:.6f}); "
          f"sync {[round(r['reshard/time_s'], 3) for r in rows]} s")


def test_every_sync_is_verified(pool_run):
    for r in pool_run["rows"]:
        assert r["reshard/pool/verified"] == 1.0, r["step"]
        assert r["reshard/verified_pieces"] > 0


def test_greedy_after_the_last_sync_equals_transformers_on_the_exported_weights(pool_run):
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenization import PromptEncoder
    from megarl.rewards import token_fraction

    tmp, cfg = pool_run["tmp"], pool_run["cfg"]
    last = pool_run["rows"][-1]
    assert "val/reward_mean" in last
    step_dir = tmp / "ckpt" / f"step_{STEPS:06d}"
    hf_dir = tmp / "hf"
    proc = subprocess.run([sys.executable, "-m", "megarl", "export", str(step_dir), "--out", str(hf_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    encoder = PromptEncoder(cfg["model"]["tokenizer"], cfg["data"]["chat_template"])
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    eos = encoder.eos_token_id
    scores = []
    for line in open(cfg["data"]["val_path"]):
        record = json.loads(line)
        ids = torch.tensor([encoder.encode(record["prompt"])])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=cfg["rollout"]["max_new_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        scores.append(token_fraction(encoder.decode(out[0, ids.shape[1]:].tolist()), record["answer"], record))
    expected = float(torch.tensor(scores, dtype=torch.float32).mean())
    assert abs(last["val/reward_mean"] - expected) <= 1e-6, (last["val/reward_mean"], expected)
