"""Pure parts of megarl.rollout: prompt-length policy, sampling settings, layout oracle (no vLLM)."""

import logging
from types import SimpleNamespace

import pytest
import torch

from megarl.rollout import OverlongPromptError, ParamShard, SamplingSettings, ShardPart, build_shard, plan_prompts

PROMPTS = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [7], [1, 2, 3, 4, 5]]


def test_plan_keeps_short_prompts_untouched(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rollout"):
        plan = plan_prompts(PROMPTS, 6, "drop")
    assert plan.kept_indices == [0, 1, 2, 3] and plan.prompts == PROMPTS
    assert plan.dropped_indices == [] and plan.truncated_indices == [] and not caplog.records


def test_plan_drop_reports_count_key_and_indices(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rollout"):
        plan = plan_prompts(PROMPTS, 4, "drop")
    assert plan.kept_indices == [0, 2] and plan.prompts == [[1, 2, 3], [7]]
    assert plan.dropped_indices == [1, 3]
    (rec,) = caplog.records
    assert "2 of 4 prompts are longer than rollout.max_prompt_tokens=4" in rec.message
    assert "dropped" in rec.message and "overlong_prompt=drop" in rec.message


def test_plan_truncate_keeps_last_tokens(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.rollout"):
        plan = plan_prompts(PROMPTS, 4, "truncate")
    assert plan.kept_indices == [0, 1, 2, 3]
    assert plan.prompts[1] == [3, 4, 5, 6] and plan.prompts[3] == [2, 3, 4, 5]
    assert plan.truncated_indices == [1, 3] and plan.dropped_indices == []
    assert "2 of 4 prompts are longer than rollout.max_prompt_tokens=4" in caplog.records[0].message


def test_plan_error_names_the_keys():
    with pytest.raises(OverlongPromptError, match=r"2 of 4 prompts are longer than rollout.max_prompt_tokens=4 "
                                                  r"\(longest 6 tokens\); raise rollout.max_prompt_tokens"):
        plan_prompts(PROMPTS, 4, "error")


def test_plan_rejects_empty_prompts_and_bad_policy():
    with pytest.raises(ValueError, match="empty prompt"):
        plan_prompts([[1], []], 4, "drop")
    with pytest.raises(ValueError, match="drop|truncate|error"):
        plan_prompts([[1]], 4, "skip")


def test_sampling_settings_from_config_and_validation():
    cfg = SimpleNamespace(samples_per_prompt=4, temperature=0.8, val_temperature=0.0, top_p=0.9, top_k=20,
                          max_new_tokens=32, stop=["\n\n"], seed=7)
    s = SamplingSettings.from_config(cfg)
    assert (s.samples_per_prompt, s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.stop, s.seed) == (
        4, 0.8, 0.9, 20, 32, ("\n\n",), 7)
    v = SamplingSettings.from_config(cfg, validation=True)
    assert v.samples_per_prompt == 1 and v.temperature == 0.0
    assert s.request_seed(0) != s.request_seed(1) and SamplingSettings(seed=None).request_seed(3) is None
    for bad in (dict(top_p=0.0), dict(top_k=0), dict(temperature=-1), dict(samples_per_prompt=0)):
        with pytest.raises(ValueError):
            SamplingSettings(**bad)


def test_build_shard_qkv_row_vocab():
    hf = {"q": torch.arange(8.0).view(8, 1).expand(8, 2).contiguous(),
          "k": 100 + torch.arange(4.0).view(4, 1).expand(4, 2),
          "o": torch.arange(16.0).view(2, 8), "e": torch.arange(10.0).view(5, 2)}
    qkv = ParamShard("qkv", (6, 2), torch.float32, "qkv", 0,
                     (ShardPart("q", 4, 4), ShardPart("k", 2, 2)), tp_rank=1, tp_size=2)
    assert build_shard(qkv, hf.__getitem__)[:, 0].tolist() == [4, 5, 6, 7, 102, 103]
    row = ParamShard("o", (2, 4), torch.float32, "row", 1, (ShardPart("o", 4, 4),), tp_rank=1, tp_size=2)
    assert build_shard(row, hf.__getitem__).tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    voc = ParamShard("e", (4, 2), torch.float32, "vocab", 0, (ShardPart("e", 3, 2),), pad_rows=2)
    assert build_shard(voc, hf.__getitem__).tolist() == [[6, 7], [8, 9], [0, 0], [0, 0]]
    with pytest.raises(ValueError, match="built shape"):
        build_shard(ParamShard("e", (3, 2), torch.float32, "vocab", 0, (ShardPart("e", 3, 2),)), hf.__getitem__)


def test_vllm_engine_refuses_to_run_inside_the_megatron_cpu_scope():
    from megarl.platform import megatron_on_cpu
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    if torch.cuda.is_available():
        pytest.skip("the CUDA->CPU mode only exists on CPU machines")
    with megatron_on_cpu(), pytest.raises(RuntimeError, match="inside megatron_on_cpu"):
        VllmRolloutEngine(VllmEngineSettings(model_path="/nonexistent"))
