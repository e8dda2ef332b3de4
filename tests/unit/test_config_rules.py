"""Config rules of megarl/config/validate.py, and refusals of the loader, arch resolution and trainer set-up
(`megarl.trainer.check_supported`, `run`'s input checks before any worker starts), that had no test asserting their
message. Each case breaks one rule of the small valid job in test_config.base() and checks the exact error text
(what is wrong, with the offending value, and what to do). Expected strings are written here by hand from the rule,
not read from the code."""

from __future__ import annotations

import os

import pytest

from megarl.config import ConfigError
from megarl.config.loader import load_config
from tests.unit.test_config import base, error, load

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    (["actor.enabled=false"], "actor.enabled: the actor is the policy being trained and cannot be disabled"),
    (["rollout.top_p=0"], "rollout.top_p: must be in (0, 1], got 0.0"),  # coerced to float by the loader
    (["rollout.top_p=1.5"], "rollout.top_p: must be in (0, 1], got 1.5"),
    (["rollout.top_k=0"], "rollout.top_k: must be -1 (disabled) or >= 1, got 0"),
    (["algorithm.clip_low=1.0"], "algorithm.clip_low: must be < 1 (ratio >= 1 - clip_low), got 1.0"),
    (["algorithm.gamma=1.5"], "algorithm.gamma: must be in [0, 1], got 1.5"),
    (["algorithm.lam=2.0"], "algorithm.lam: must be in [0, 1], got 2.0"),
    (["actor.optimizer.lr=1e-6", "actor.optimizer.min_lr=1e-5"],
     "actor.optimizer.min_lr=1e-05 is larger than lr=1e-06"),
    (["actor.optimizer.betas=[0.9,1.0]"], "actor.optimizer.betas: each beta must be in [0, 1), got [0.9, 1.0]"),
    (["trainer.val_every=2"], "trainer.val_every=2 needs data.val_path (or set val_every=0)"),
    (["checkpoint.save_every=5"], "checkpoint.save_every=5 needs checkpoint.dir"),
    # actor dp=2 (4 devices / tp 2), micro-batches by token budget (no sample count): a mini-batch of 1 prompt x 3
    # samples cannot split over 2 DP ranks
    (["actor.micro_batch_samples=null", "actor.micro_batch_tokens=1024", "rollout.samples_per_prompt=3",
      "actor.mini_batch_prompts=1"],
     "actor.parallel.dp: a mini-batch's actor.mini_batch_prompts * rollout.samples_per_prompt = 1*3 = 3 samples "
     "is not divisible by dp=2"),
    # 6 heads in 3 KV groups: rollout tp=2 divides the heads but neither splits nor replicates 3 groups evenly
    (["model.arch.num_attention_heads=6", "model.arch.num_query_groups=3", "actor.parallel.tp=1",
      "actor.micro_batch_samples=1", "rollout.tp=2"],
     "rollout.tp: num_query_groups=3 and tp=2: one must divide the other (vLLM splits or replicates the KV heads)"),
    (["model.arch.head_dim=48"],
     "model: head_dim=48 is not supported by vLLM's CPU attention "
     "(supported: 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)"),
]


def test_base_is_valid(tmp_path):
    load(tmp_path, base())  # every failure below comes from its one override


@pytest.mark.parametrize("overrides,message", CASES, ids=[c[0][-1] for c in CASES])
def test_rule_message(tmp_path, overrides, message):
    assert error(tmp_path, base(), overrides) == message


def test_no_pools(tmp_path):
    data = base()
    data["resources"]["pools"] = {}
    assert error(tmp_path, data) == "resources.pools: at least one pool is needed"


# ------------------------------------------------- loader, arch and trainer set-up errors that had no message test
# Expected strings written by hand from each refusal (what is wrong, the offending value, what to do).


@pytest.mark.parametrize("name,text,message", [
    ("empty.yaml", "", "the config file is empty"),
    ("list.yaml", "- actor\n- rollout\n", "the top level must be a mapping of sections, got list"),
])
def test_unreadable_config_file(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {message}"


def test_override_into_a_scalar(tmp_path):
    assert (error(tmp_path, base(), ["model.arch.num_layers.x=3"])
            == "cannot set 'model.arch.num_layers.x': 'model.arch.num_layers' is 2, not a section")


def test_section_given_a_scalar(tmp_path):
    data = base()
    data["actor"]["parallel"] = 3
    assert error(tmp_path, data) == "actor.parallel: expected a mapping (section), got 3"


def test_tuple_of_the_wrong_length(tmp_path):
    assert (error(tmp_path, base(), ["actor.optimizer.betas=[0.9]"])
            == "actor.optimizer.betas: expected list of 2 (float, float), got 1 values [0.9]")


def test_mapping_key_of_the_wrong_type(tmp_path):
    data = base()
    data["resources"]["pools"] = {1: {"nodes": 1, "devices_per_node": 4}}  # YAML int key, pool names are str
    assert error(tmp_path, data) == "resources.pools.1: expected a str key, got 1"


def test_model_path_config_json_not_an_object(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[1, 2]")
    data = base()
    del data["model"]["arch"]
    data["model"]["path"] = str(model)
    assert error(tmp_path, data) == f"model.path: {model / 'config.json'} must hold a JSON object"


def test_trainer_refuses_kl_in_the_reward_with_sequence_score_advantages(tmp_path):
    # `check_supported` is part of `validate`: the refusal comes at load time (so `--dry-run` shows it too)
    msg = error(tmp_path, base(), ["reference.enabled=true", "algorithm.kl.coef=0.01", "algorithm.kl.placement=reward"])
    assert msg == ("algorithm.kl.placement: 'grpo' advantages use sequence scores and ignore token rewards, so a KL "
                   "penalty in the reward would be dropped; use placement=loss")


def test_trainer_refuses_two_side_roles_on_one_separate_pool(tmp_path):
    data = base()
    data["resources"]["pools"]["side"] = {"nodes": 1, "devices_per_node": 1}
    msg = error(tmp_path, data, ["algorithm.name=ppo", "reference.enabled=true", "reference.pool=side",
                                 "critic.enabled=true", "critic.pool=side"])
    assert msg == ("critic.pool: pool 'side' already hosts the reference; a pool away from the actor hosts one role "
                   "(give each its own pool, or colocate with the actor)")


def test_greedy_rollout_with_several_samples_per_prompt(tmp_path):
    # vLLM refuses n > 1 with greedy sampling in the middle of a run ("n must be 1 when using greedy sampling")
    msg = error(tmp_path, base(), ["rollout.temperature=0", "rollout.samples_per_prompt=4"])
    assert msg == ("rollout.temperature=0 (greedy) with rollout.samples_per_prompt=4: greedy decoding gives every "
                   "sample of a prompt the same response; use temperature > 0, or samples_per_prompt=1")


def test_rollout_engine_needs_a_tokenizer(tmp_path):
    from megarl.trainer.engine_model_dir import engine_model_dir

    with pytest.raises(ValueError) as e:
        engine_model_dir(load(tmp_path, base()), str(tmp_path))
    assert str(e.value) == ("model.tokenizer: the rollout engine needs a tokenizer; set model.tokenizer to a HF "
                            "tokenizer directory (model.path has none: an inline model.arch is used)")


def _run_error(tmp_path, overrides) -> str:
    """The ConfigError `megarl.trainer.run` raises while checking its inputs, before Ray or any worker starts."""
    from megarl import trainer

    with pytest.raises(ConfigError) as e:
        trainer.run(load(tmp_path, base(), [f"logging.dir={tmp_path / 'run'}", *overrides]))
    return str(e.value)


def test_trainer_names_a_missing_train_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    assert (_run_error(tmp_path, [f"data.train_path={missing}"])
            == f"data.train_path: prompt dataset '{missing}' does not exist")


def test_trainer_names_an_unknown_reward_function(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "w3 w4", "answer": "w3"}\n')
    tokenizer = os.path.join(ROOT, "data", "quickstart", "tokenizer")
    msg = _run_error(tmp_path, [f"data.train_path={train}", f"model.tokenizer={tokenizer}", "data.chat_template=none",
                                "reward.function=nope"])
    assert msg == ("reward.function: unknown reward function 'nope'; "
                   "valid: exact_match, gsm8k, token_fraction")
