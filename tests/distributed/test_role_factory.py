"""Roles built from a job config that points at an HF directory: the weights load directly at the configured
layout (no offline conversion), and the actor (TP=2) and reference (PP=2) reproduce transformers' log-probs."""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks

CONFIG = """
model: {{path: {hf_dir}, dtype: fp32}}
resources: {{device: cpu, pools: {{default: {{nodes: 1, devices_per_node: 2}}}}}}
actor:
  parallel: {{tp: 2}}
  optimizer: {{lr: 1.0e-4}}
  micro_batch_samples: 2
reference: {{enabled: true, parallel: {{pp: 2}}, micro_batch_tokens: 64}}
rollout: {{tp: 2, samples_per_prompt: 2, max_prompt_tokens: 16, max_new_tokens: 16}}
algorithm: {{name: grpo, kl: {{coef: 0.001, placement: loss}}}}
data: {{train_path: unused.jsonl, prompts_per_step: 2}}
trainer: {{total_steps: 1}}
"""


def _worker(rank, world_size, config_path, input_ids):
    from megarl.config import load_config
    from megarl.data.batch import Batch
    from megarl.roles.factory import build_role

    cfg = load_config(config_path)
    out = {}
    ids = torch.tensor(input_ids)
    mask = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, 4:] = 1
    batch = Batch({"input_ids": ids, "attention_mask": mask, "response_mask": resp})
    for role in ("actor", "reference"):
        r = build_role(cfg, role)
        res = r.compute_log_probs(batch, with_entropy=False)
        out[role] = {"layout": r.groups.topology.describe(),
                     "log_probs": None if res is None else res.tensors["log_probs"],
                     "trainable": r.engine.trainable}
    return out


@pytest.fixture(scope="module")
def factory_run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.tiny import make_hf_model

    root = tmp_path_factory.mktemp("factory")
    hf_dir = make_hf_model("llama", str(root / "hf"))
    config_path = root / "job.yaml"
    config_path.write_text(CONFIG.format(hf_dir=hf_dir))
    input_ids = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids).logits.float(), -1)
    expected = torch.zeros(input_ids.shape)
    expected[:, 1:] = logp[:, :-1].gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    expected[:, :4] = 0
    return run_ranks(2, _worker, str(config_path), input_ids.tolist(), timeout_s=600), expected


@pytest.mark.parametrize("role,layout", [("actor", "tp=2 pp=1 dp=1 cp=1"), ("reference", "tp=1 pp=2 dp=1 cp=1")])
def test_config_built_roles_match_transformers(factory_run, role, layout):
    per_rank, expected = factory_run
    results = [r[role] for r in per_rank]
    assert all(r["layout"] == layout for r in results)
    assert [r["trainable"] for r in results] == [role == "actor"] * 2
    reported = [r["log_probs"] for r in results if r["log_probs"] is not None]
    assert reported, f"{role}: no rank returned log-probs"
    for lp in reported:
        torch.testing.assert_close(lp, expected, atol=1e-5, rtol=0)
