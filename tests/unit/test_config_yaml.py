"""Every config in yaml_configs/ loads and validates; docs/config.md is in sync with the schema.

Configs for real models point `model.path` at a checkpoint directory (e.g. /models/Qwen2.5-7B-Instruct) that
does not exist here. The test writes that model's real config.json (numbers from the HuggingFace hub) into a
temporary directory and overrides `model.path` with it, so the rules run against the real architecture. A new
path-based config needs its model's config.json added to HF_CONFIGS below.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.docs import render_markdown
from megarl.config.loader import read_yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "yaml_configs").glob("*.yaml"))

HF_CONFIGS = {
    "Qwen2.5-7B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
    },
    "Meta-Llama-3-8B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
    },
    # the tool-use quickstart's model (megarl/data/tool_task.py: MODEL_SHAPE, 256 embedding rows)
    "sft_model": {"architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                  "vocab_size": 256, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": False, "torch_dtype": "float32"},
}


def _model_path_overrides(raw: dict, tmp_path: Path) -> list[str]:
    """`key.path=<fixture dir>` for every model path in the raw config (top-level model, critic, reward model)."""
    overrides = []
    for key, section in [("model", raw.get("model"))] + [
        (f"{role}.model", (raw.get(role) or {}).get("model")) for role in ("critic", "reward_model")
    ]:
        path = (section or {}).get("path")
        if path is None:
            continue
        name = os.path.basename(path.rstrip("/"))
        assert name in HF_CONFIGS, f"add the config.json of {name} to HF_CONFIGS to test {key}.path={path}"
        fixture = tmp_path / name
        fixture.mkdir(exist_ok=True)
        (fixture / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
        overrides.append(f"{key}.path={fixture}")
    return overrides


def test_there_are_configs():
    names = {p.name for p in CONFIGS}
    assert {"cpu_quickstart.yaml", "gsm8k_grpo_qwen2_7b.yaml", "gsm8k_ppo_llama3_8b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_validates(path, tmp_path):
    from megarl.trainer import check_supported

    cfg = load_config(path, _model_path_overrides(read_yaml(path), tmp_path))
    assert cfg.actor.parallel.dp is not None
    check_supported(cfg)  # every shipped config is one the trainer runs (nothing it would refuse)


def test_gpu_configs_resolve_as_documented(tmp_path):
    path = REPO / "yaml_configs" / "gsm8k_ppo_llama3_8b.yaml"
    cfg = load_config(path, _model_path_overrides(read_yaml(path), tmp_path))
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.dp) == (4, 2, 2)
    assert cfg.reference.parallel.dp == 4 and cfg.algorithm.advantage_estimator == "gae"
    path = REPO / "yaml_configs" / "gsm8k_grpo_qwen2_7b.yaml"
    cfg = load_config(path, _model_path_overrides(read_yaml(path), tmp_path))
    assert cfg.actor.parallel.dp == 2 and cfg.actor.micro_batch_tokens == 16384


def test_docs_in_sync():
    doc = REPO / "docs" / "config.md"
    assert doc.read_text() == render_markdown(), "docs/config.md is stale: run python -m megarl.config.docs"


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.kl.target=0.1", "algorithm.kl.coef=0.01"], "algorithm.kl.target: the adaptive KL controller"),
    (["algorithm.kl.placement=reward", "algorithm.kl.coef=0.01"], "algorithm.kl.placement: 'grpo' advantages"),
    (["logging.backends=[console, mlflow]"], "logging.backends[1]: expected one of"),
])
def test_trainer_refuses_what_it_would_otherwise_ignore(overrides, message, capsys):
    from megarl.cli import main
    from megarl.config import ConfigError

    # refused when the config loads (validate runs the trainer's check_supported) ...
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(REPO / "yaml_configs" / "cpu_quickstart.yaml", overrides)
    # ... so `megarl train --dry-run` refuses it too, exit status 2, before anything starts
    assert main(["train", str(REPO / "yaml_configs" / "cpu_quickstart.yaml"), *overrides, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


TIS = "algorithm.rollout_correction.tis=token"


@pytest.mark.parametrize("config,overrides,message", [
    ("cpu_quickstart.yaml", ["trainer.mode=one_step_off"], "trainer.mode='one_step_off' trains on rollouts sampled "
     "by older weights and needs the off-policy correction: set algorithm.rollout_correction.tis"),
    ("cpu_quickstart.yaml", ["trainer.mode=async", TIS], "trainer.mode='async' runs the engines continuously beside "
     "training and needs devices of their own: set rollout.pool"),
    ("cpu_quickstart_rollout_pool.yaml", ["trainer.mode=async", TIS, "trainer.max_staleness=1",
                                          "trainer.sync_every=3"], "trainer.sync_every=3 with trainer.max_staleness=1"),
    ("cpu_quickstart.yaml", ["trainer.max_staleness=3"], "trainer.max_staleness=3 applies to trainer.mode=async only"),
    ("cpu_quickstart_rollout_pool.yaml", ["trainer.mode=one_step_off", TIS, "rollout.partial=continue"],
     "rollout.partial=continue applies to trainer.mode=async"),
    ("cpu_quickstart.yaml", ["trainer.mode=one_step_off", TIS, "algorithm.dynamic_sampling.enabled=true",
                             "rollout.samples_per_prompt=4"], "algorithm.dynamic_sampling with trainer.mode="),
])
def test_schedule_options_are_refused_by_key_where_they_cannot_work(config, overrides, message):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(REPO / "yaml_configs" / config, overrides)


@pytest.mark.parametrize("config,overrides", [
    ("cpu_quickstart.yaml", ["trainer.mode=one_step_off", TIS]),  # colocated one_step_off
    ("cpu_quickstart_rollout_pool.yaml", ["trainer.mode=one_step_off", "algorithm.rollout_correction.mask=token"]),
    ("cpu_quickstart_rollout_pool.yaml", ["trainer.mode=async", TIS, "trainer.max_staleness=4",
                                          "trainer.sync_every=5", "trainer.stale_policy=drop",
                                          "rollout.partial=continue"]),
    # a stop string with partial=continue: a push no longer cuts a response into pieces (the request continues)
    ("cpu_quickstart_rollout_pool.yaml", ["trainer.mode=async", TIS, "rollout.partial=continue", "rollout.stop=[x]"]),
    # episodes with one_step_off: produced through the request servers like any batch (test_schedule.py's episodes)
    ("cpu_quickstart.yaml", ["trainer.mode=one_step_off", TIS, "rollout.env=calculator", "data.chat_template=hf"]),
])
def test_schedule_options_accepted_where_they_work(config, overrides):
    cfg = load_config(REPO / "yaml_configs" / config, overrides)
    assert cfg.trainer.mode == overrides[0].split("=")[1]


@pytest.mark.parametrize("overrides,message", [
    (["rollout.env=calculator"], "rollout.env='calculator' renders tool results and observations with the chat "
     "template: set data.chat_template"),
    (["rollout.env=calculator", "data.chat_template=hf", "rollout.max_tokens_per_turn=64",
      "rollout.max_new_tokens=32"], "rollout.max_tokens_per_turn=64 exceeds rollout.max_new_tokens=32"),
])
def test_multi_turn_options_are_refused_by_key_where_they_cannot_work(overrides, message):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(REPO / "yaml_configs" / "cpu_quickstart.yaml", overrides)


def test_an_unknown_environment_is_refused_naming_the_key_and_the_choices():
    from megarl.config import ConfigError
    from megarl.envs import build_env_factory

    with pytest.raises(ConfigError, match=r"rollout\.env.*calculater.*calculator"):
        build_env_factory("calculater")
    with pytest.raises(ConfigError, match=r"rollout\.env=.*nowhere\.py:make.*does not exist"):
        build_env_factory("nowhere.py:make")
