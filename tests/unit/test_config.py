"""megarl.config: YAML loading, override coercion, error messages (text, not just type), cross-field rules."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

from megarl.config import ConfigError, JobConfig, dump_yaml, load_config, parse_config, to_dict, validate
from megarl.config.loader import read_yaml


def base() -> dict:
    """A small valid job: tiny Llama on a cpu pool of 4 devices, actor tp=2 (dp=2), GRPO."""
    return {
        "model": {
            "arch": {
                "architecture": "LlamaForCausalLM",
                "num_layers": 2,
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_query_groups": 2,
                "head_dim": 32,
                "ffn_hidden_size": 256,
                "vocab_size": 512,
                "max_position_embeddings": 256,
            },
            "dtype": "fp32",
        },
        "resources": {"device": "cpu", "pools": {"default": {"nodes": 1, "devices_per_node": 4}}},
        "actor": {"parallel": {"tp": 2}, "micro_batch_samples": 2, "mini_batch_prompts": 2},
        "rollout": {"tp": 2, "samples_per_prompt": 2, "max_prompt_tokens": 64, "max_new_tokens": 32},
        "algorithm": {"name": "grpo"},
        "data": {"train_path": "train.jsonl", "prompts_per_step": 4},
        "trainer": {"total_steps": 3},
    }


def load(tmp_path, data: dict, overrides=()) -> JobConfig:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, list(overrides))


def error(tmp_path, data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load(tmp_path, data, overrides)
    return str(e.value)


# ----------------------------------------------------------------------------------------------- loading, coercion


def test_base_loads_and_resolves(tmp_path):
    cfg = load(tmp_path, base())
    assert cfg.actor.parallel.dp == 2  # 4 devices / tp 2
    assert cfg.reference.micro_batch_samples is None  # disabled roles are left alone
    assert cfg.algorithm.advantage_estimator == "grpo"
    assert cfg.critic.enabled is False


def test_override_coercion(tmp_path):
    cfg = load(
        tmp_path,
        base(),
        [
            "actor.parallel.tp=1",
            "actor.micro_batch_samples=1",
            "algorithm.kl.coef=0.001",
            "reference.enabled=yes",
            "data.shuffle=0",
            "checkpoint.resume=False",
            "actor.optimizer.lr=1e-5",  # YAML 1.1 reads 1e-5 as a string; the float field still takes it
            "actor.optimizer.betas=[0.8, 0.95]",
            'rollout.stop=["a","b"]',
            "logging.backends=jsonl",  # a single value is a one-element list
            "data.prompt_key=123",  # a str field keeps the text
            "data.val_path=val.jsonl",
            "trainer.val_every=2",
            "checkpoint.dir=null",
            "rollout.temperature=1",  # int -> float
            "resources.pools.spare.nodes=2",
        ],
    )
    assert cfg.actor.parallel.tp == 1 and cfg.actor.parallel.dp == 4
    assert cfg.algorithm.kl.coef == 0.001
    assert cfg.reference.enabled is True and cfg.data.shuffle is False and cfg.checkpoint.resume is False
    assert cfg.actor.optimizer.lr == 1e-5
    assert cfg.actor.optimizer.betas == (0.8, 0.95)
    assert cfg.rollout.stop == ("a", "b")
    assert cfg.logging.backends == ("jsonl",)
    assert cfg.data.prompt_key == "123"
    assert cfg.checkpoint.dir is None
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.resources.pools["spare"].nodes == 2 and cfg.resources.pools["spare"].devices_per_node == 1


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("on", True), ("no", False), ("0", False)])
def test_bool_spellings(tmp_path, text, value):
    assert load(tmp_path, base(), [f"data.shuffle={text}"]).data.shuffle is value


def test_round_trip(tmp_path):
    cfg = load(tmp_path, base(), ["reference.enabled=true", "algorithm.kl.coef=0.01", 'rollout.stop=["x"]'])
    assert parse_config(to_dict(cfg)) == cfg
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(cfg))
    assert load_config(again) == cfg
    assert validate(cfg) == cfg  # resolving is idempotent


def test_configs_are_frozen(tmp_path):
    cfg = load(tmp_path, base())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.parallel.tp = 8


# ----------------------------------------------------------------------------------------------- parse errors


def test_unknown_key_override_suggests(tmp_path):
    msg = error(tmp_path, base(), ["actor.paralel.tp=2"])
    assert msg == "unknown key 'actor.paralel' (did you mean 'actor.parallel'?)"


def test_unknown_key_in_yaml_suggests(tmp_path):
    data = base()
    data["rollout"]["temprature"] = 0.7
    assert error(tmp_path, data) == "unknown key 'rollout.temprature' (did you mean 'rollout.temperature'?)"


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    msg = error(tmp_path, base(), ["algorithm.kl.zzz=1"])
    assert msg.startswith("unknown key 'algorithm.kl.zzz' (valid keys under 'algorithm.kl': coef, kind,")


def test_wrong_type(tmp_path):
    assert error(tmp_path, base(), ["actor.parallel.tp=two"]) == "actor.parallel.tp: expected int, got 'two'"
    data = base()
    data["data"]["shuffle"] = "maybe"
    assert error(tmp_path, data) == "data.shuffle: expected bool, got 'maybe'"


def test_wrong_choice_suggests(tmp_path):
    msg = error(tmp_path, base(), ["algorithm.name=grpoo"])
    assert msg == (
        "algorithm.name: expected one of 'grpo', 'ppo', 'rloo', 'reinforce_plus_plus', 'dr_grpo', 'gspo', 'cispo', "
        "got 'grpoo' (did you mean 'grpo'?)"
    )


def test_below_minimum(tmp_path):
    assert error(tmp_path, base(), ["rollout.max_new_tokens=0"]) == "rollout.max_new_tokens: must be >= 1, got 0"


def test_missing_required_key(tmp_path):
    data = base()
    del data["data"]["train_path"]
    assert error(tmp_path, data).startswith("missing required key 'data.train_path': Training prompts")
    data = base()
    del data["trainer"]
    assert error(tmp_path, data).startswith("missing required key 'trainer.total_steps'")


def test_malformed_yaml_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  dtype: fp32\ndata: {train_path: x, prompts_per_step: 4\ntrainer: {total_steps: 1}\n")
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:4:") and "malformed YAML" in msg


def test_duplicate_yaml_key(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer: {total_steps: 1}\ntrainer: {total_steps: 2}\n")
    with pytest.raises(ConfigError, match=r"dup.yaml:2:1: malformed YAML: duplicate key 'trainer' \(first at line 1\)"):
        read_yaml(path)


def test_malformed_override(tmp_path):
    msg = error(tmp_path, base(), ["actor.parallel.tp"])
    assert msg == "malformed override 'actor.parallel.tp': no '=' (expected key=value, e.g. actor.parallel.tp=2)"
    assert "empty key" in error(tmp_path, base(), ["actor..tp=2"])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


# ----------------------------------------------------------------------------------------------- cross-field rules


def test_world_size_mismatch(tmp_path):
    msg = error(tmp_path, base(), ["actor.parallel.dp=3"])
    assert msg == "actor.parallel: tp*pp*cp*dp = 2*1*1*3 = 6 does not equal the 4 devices of pool 'default'"


def test_model_parallel_does_not_divide_devices(tmp_path):
    msg = error(tmp_path, base(), ["actor.parallel.tp=1", "actor.parallel.pp=3"])
    assert msg == "actor.parallel: tp*pp*cp = 1*3*1 = 3 does not divide the 4 devices of pool 'default', so no dp fits"


def test_heads_not_divisible_by_tp(tmp_path):
    data = base()
    data["model"]["arch"]["num_attention_heads"] = 6
    data["model"]["arch"]["num_query_groups"] = 6
    assert error(tmp_path, data, ["actor.parallel.tp=4", "rollout.tp=1"]) == (
        "actor.parallel.tp: num_attention_heads=6 is not divisible by tp=4"
    )


def test_query_groups_not_divisible_by_tp(tmp_path):
    assert error(tmp_path, base(), ["actor.parallel.tp=4"]) == (
        "actor.parallel.tp: num_query_groups=2 is not divisible by tp=4"
    )


def test_layers_not_divisible_by_pp_and_uneven_split(tmp_path):
    data = base()
    data["model"]["arch"]["num_layers"] = 3
    msg = error(tmp_path, data, ["actor.parallel.pp=2"])
    assert msg.startswith("actor.parallel: num_layers=3 is not divisible by pp=2")
    cfg = load(tmp_path, data, ["actor.parallel.pp=2", "actor.parallel.first_stage_layers=1"])
    assert cfg.actor.parallel.dp == 1
    msg = error(tmp_path, data, ["actor.parallel.pp=2", "actor.parallel.first_stage_layers=5"])
    assert "cannot split num_layers=3 over pp=2 with first_stage_layers=5" in msg


def test_virtual_pipeline_rules(tmp_path):
    data = base()
    data["model"]["arch"]["num_layers"] = 4
    cfg = load(tmp_path, data, ["actor.parallel.tp=1", "actor.parallel.pp=2", "actor.parallel.vpp=2"])
    assert cfg.actor.parallel.vpp == 2 and cfg.actor.parallel.dp == 2 and cfg.reference.parallel.vpp == 1
    assert error(tmp_path, data, ["actor.parallel.vpp=2"]).startswith(
        "actor.parallel.vpp: vpp=2 needs pp > 1 (virtual chunks interleave pipeline stages), got pp=1")
    msg = error(tmp_path, data, ["actor.parallel.tp=1", "actor.parallel.pp=2", "actor.parallel.vpp=4"])
    assert msg.startswith("actor.parallel.vpp: num_layers=4 is not divisible by pp*vpp=2*4=8")
    msg = error(tmp_path, data, ["actor.parallel.tp=1", "actor.parallel.pp=2", "actor.parallel.vpp=2",
                                 "actor.parallel.first_stage_layers=1"])
    assert "vpp > 1 with first_stage_layers / last_stage_layers is not supported" in msg
    assert "actor.parallel.vpp" in error(tmp_path, data, ["actor.parallel.vpp=0"])


def test_virtual_pipeline_with_experts(tmp_path):
    """MoE at vpp > 1: accepted (also with router replay), except router losses at tp > 1 (no padding mask reaches
    the routers under sequence parallelism, and the interleaved schedule pads micro-batches to one shape)."""
    data = base()
    data["model"]["arch"].update(architecture="Qwen3MoeForCausalLM", num_layers=4, num_experts=4, moe_topk=2,
                                 moe_ffn_hidden_size=64)
    vpp = ["actor.parallel.pp=2", "actor.parallel.vpp=2"]
    cfg = load(tmp_path, data, ["actor.parallel.tp=1", *vpp, "actor.moe.aux_loss_coeff=0.01",
                                "algorithm.router_replay=old"])
    assert cfg.actor.parallel.vpp == 2 and cfg.actor.parallel.dp == 2
    assert load(tmp_path, data, vpp).actor.parallel.tp == 2  # tp 2 without router losses
    msg = error(tmp_path, data, [*vpp, "actor.moe.z_loss_coeff=0.001"])
    assert msg.startswith("actor.parallel.vpp: vpp > 1 with mixture-of-experts router losses at tp=2 is not supported")


def test_rollout_tp_must_divide_actor_devices(tmp_path):
    data = base()
    data["resources"]["pools"]["default"]["devices_per_node"] = 6
    data["model"]["arch"].update(num_attention_heads=6, num_query_groups=6)
    data["data"]["prompts_per_step"] = 6
    msg = error(
        tmp_path, data,
        ["actor.parallel.tp=2", "rollout.tp=4", "actor.mini_batch_prompts=null", "actor.micro_batch_samples=1"],
    )
    assert msg.startswith("rollout.tp=4 does not divide the actor's 6 devices (pool 'default')")


def test_global_batch_not_divisible_by_dp_times_micro(tmp_path):
    msg = error(tmp_path, base(), ["actor.micro_batch_samples=3", "actor.mini_batch_prompts=null"])
    assert msg == (
        "actor.micro_batch_samples: the step's data.prompts_per_step * rollout.samples_per_prompt = 4*2 = 8 samples "
        "is not divisible by dp*micro_batch_samples = 2*3 = 6"
    )


def test_mini_batch_rules(tmp_path):
    assert error(tmp_path, base(), ["actor.mini_batch_prompts=3"]) == (
        "actor.mini_batch_prompts: data.prompts_per_step=4 is not divisible by mini_batch_prompts=3"
    )
    assert error(tmp_path, base(), ["actor.mini_batch_prompts=1"]) == (
        "actor.micro_batch_samples: a mini-batch's actor.mini_batch_prompts * rollout.samples_per_prompt = 1*2 = 2 "
        "samples is not divisible by dp*micro_batch_samples = 2*2 = 4"
    )


def test_dynamic_batching_rules(tmp_path):
    cfg = load(tmp_path, base(), ["actor.micro_batch_samples=null", "actor.micro_batch_tokens=96"])
    assert cfg.actor.micro_batch_tokens == 96 and cfg.actor.micro_batch_samples is None
    assert error(tmp_path, base(), ["actor.micro_batch_tokens=96"]).startswith(
        "actor: set only one of micro_batch_samples=2 and micro_batch_tokens=96"
    )
    assert error(tmp_path, base(), ["actor.micro_batch_samples=null", "actor.micro_batch_tokens=50"]) == (
        "actor.micro_batch_tokens=50 cannot hold the longest sample: rollout.max_prompt_tokens + "
        "rollout.max_new_tokens = 64 + 32 = 96"
    )


def test_sequence_longer_than_positions(tmp_path):
    assert error(tmp_path, base(), ["rollout.max_prompt_tokens=200", "rollout.max_new_tokens=100"]) == (
        "rollout: max_prompt_tokens + max_new_tokens = 200 + 100 = 300 exceeds model max_position_embeddings=256"
    )


def test_unknown_pool_suggests(tmp_path):
    assert error(tmp_path, base(), ["actor.pool=defualt"]) == (
        "actor.pool: unknown pool 'defualt' (did you mean 'default'?); resources.pools has: default"
    )


def test_algorithm_role_requirements(tmp_path):
    assert error(tmp_path, base(), ["algorithm.name=ppo", "rollout.samples_per_prompt=1"]).startswith(
        "critic.enabled: advantage_estimator=gae needs the critic"
    )
    assert error(tmp_path, base(), ["algorithm.kl.coef=0.01"]).startswith(
        "reference.enabled: algorithm.kl.coef=0.01 needs the reference policy"
    )
    assert error(tmp_path, base(), ["rollout.samples_per_prompt=1", "actor.mini_batch_prompts=null"]).startswith(
        "rollout.samples_per_prompt=1: advantage_estimator=grpo compares the samples"
    )
    assert error(tmp_path, base(), ["algorithm.clip_c=0.5"]) == (
        "algorithm.clip_c: the dual-clip constant must be > 1, got 0.5"
    )


def test_ppo_with_critic_on_its_own_pool(tmp_path):
    data = base()
    data["resources"]["pools"]["critic"] = {"nodes": 1, "devices_per_node": 2}
    cfg = load(
        tmp_path,
        data,
        ["algorithm.name=ppo", "rollout.samples_per_prompt=1", "critic.enabled=true", "critic.pool=critic",
         "critic.parallel.tp=2", "actor.micro_batch_samples=1"],
    )
    assert cfg.algorithm.advantage_estimator == "gae"
    assert cfg.critic.parallel.dp == 1 and cfg.critic.micro_batch_samples == 1


# ----------------------------------------------------------------------------------------------- model.path


HF_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 4,
    "hidden_size": 192,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "intermediate_size": 384,
    "vocab_size": 1000,
    "max_position_embeddings": 512,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-6,
}


def _with_path(tmp_path, hf: dict | str | None) -> dict:
    model_dir = tmp_path / "hf_model"
    model_dir.mkdir(exist_ok=True)
    if hf is not None:
        (model_dir / "config.json").write_text(hf if isinstance(hf, str) else json.dumps(hf))
    data = base()
    data["model"] = {"path": str(model_dir)}
    return data


def test_model_path_reads_config_json(tmp_path):
    data = _with_path(tmp_path, HF_LLAMA)
    cfg = load(tmp_path, data)
    assert cfg.model.path.endswith("hf_model") and cfg.model.arch is None
    from megarl.config import resolve_arch

    arch = resolve_arch(cfg.model)
    assert (arch.num_layers, arch.num_query_groups, arch.head_dim, arch.rope_theta) == (4, 2, 32, 500000.0)
    # the numbers from config.json drive the rules: 6 heads do not split over tp=4
    assert error(tmp_path, data, ["actor.parallel.tp=4"]) == (
        "actor.parallel.tp: num_attention_heads=6 is not divisible by tp=4"
    )


def test_model_path_without_config_json(tmp_path):
    msg = error(tmp_path, _with_path(tmp_path, None))
    assert msg.startswith(f"model.path: no config.json in '{tmp_path / 'hf_model'}'")


def test_model_path_unreadable_config_json(tmp_path):
    msg = error(tmp_path, _with_path(tmp_path, "{not json"))
    assert msg.startswith("model.path: ") and "is not valid JSON (line 1" in msg
    msg = error(tmp_path, _with_path(tmp_path, {**HF_LLAMA, "architectures": ["GPT2LMHeadModel"]}))
    assert "architecture 'GPT2LMHeadModel' is not supported" in msg


def test_model_path_and_arch_are_exclusive(tmp_path):
    data = _with_path(tmp_path, HF_LLAMA)
    data["model"]["arch"] = base()["model"]["arch"]
    assert error(tmp_path, data).startswith("model: set exactly one of 'model.path'")


def test_critic_and_reward_model_run_their_own_model(tmp_path):
    data = _with_path(tmp_path, HF_LLAMA)  # a 6-head model at model.path
    data["model"] = base()["model"]  # the actor keeps the tiny inline arch (4 heads)
    ppo = ["algorithm.name=ppo", "rollout.samples_per_prompt=1", "critic.enabled=true", "critic.parallel.tp=4",
           "actor.micro_batch_samples=1"]
    # critic.model is null in the YAML; the override creates the section, and the critic's tp=4 is checked
    # against its own model's 6 heads, not the actor's 4
    msg = error(tmp_path, data, ppo + [f"critic.model.path={tmp_path / 'hf_model'}"])
    assert msg == "critic.parallel.tp: num_attention_heads=6 is not divisible by tp=4"
    assert error(tmp_path, data, ["reward_model.enabled=true"]).startswith(
        "reward_model.model: required when reward_model.enabled is true"
    )
