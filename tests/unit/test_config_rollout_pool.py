"""`rollout.pool`: the engines on a pool of their own. Validation (numbers and keys named), the dry-run's lines
(the rollout pool, its engines, the sync's bytes per rank), the memory split, the placement rows; the colocated
default (null) is unchanged."""

from __future__ import annotations

import os

import pytest

from megarl.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
POOL_YAML = os.path.join(ROOT, "yaml_configs", "cpu_quickstart_rollout_pool.yaml")


def cfg(*overrides):
    return load_config(POOL_YAML, list(overrides))


def refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        cfg(*overrides)
    return str(e.value)


def test_the_pool_config_loads_and_the_default_is_colocated():
    c = cfg()
    assert c.rollout.pool == "rollout" and c.actor.pool == "train"
    colocated = load_config(os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml"))
    assert colocated.rollout.pool is None


def test_refusals_name_the_key_and_the_numbers():
    assert refusal("rollout.pool=rollot").startswith("rollout.pool: unknown pool 'rollot' (did you mean 'rollout'?)")
    assert "hosts the actor" in refusal("rollout.pool=train")
    assert refusal("rollout.tp=2", "resources.pools.rollout.devices_per_node=3") \
        .startswith("rollout.tp=2 does not divide the 3 devices of the rollout pool 'rollout'")
    assert "also hosts the reference" in refusal("reference.pool=rollout", "reference.parallel.tp=2")
    import dataclasses

    from megarl.config.validate import check_supported

    c = cfg()  # a dense model refuses replay earlier; the pool's own refusal, on the resolved config:
    with pytest.raises(ConfigError, match=r"^algorithm.router_replay: 'rollout' with rollout.pool='rollout' is not "):
        check_supported(dataclasses.replace(c, algorithm=dataclasses.replace(c.algorithm, router_replay="rollout")))
    assert "rollout.pool='rollout' is not supported yet" in refusal("rollout.ep=true")
    assert refusal("resources.device=cuda").startswith("rollout.pool: 'rollout' with resources.device='cuda'")


def test_dry_run_names_the_pool_its_engines_and_the_bytes_per_rank():
    from megarl.cli import dry_run_report
    from megarl.reshard.pool_plan import config_pool_plan

    c = cfg()
    report = dry_run_report(c)
    plan = config_pool_plan(c)
    t = plan.traffic()
    # a TP1 engine receives the whole model; the two actor ranks share the sending
    assert t.max_received == t.mean_received == plan.model_bytes
    assert t.mean_sent == plan.model_bytes and t.max_sent - t.mean_sent <= 128 * 4
    assert "# rollout pool 'rollout' and the weight sync" in report
    assert "rollout ranks -> bridge 2..3 (2 engine(s) x tp 1)" in report
    assert f"received per rollout rank: max {plan.model_bytes / 2**20:.2f} MiB" in report
    assert "# memory per GPU of the rollout pool 'rollout'" in report
    assert "vLLM: none on the actor's pool" in report
    rollout_rows = [line.split() for line in report.splitlines() if line.startswith("rollout ")]
    assert [(r[1], r[6]) for r in rollout_rows] == [("2", "0"), ("3", "1")]  # global ranks 2, 3; engines 0, 1


def test_placement_summary_prints_the_rollout_pool():
    from megarl.trainer.session import placement_summary

    text = placement_summary(cfg(), "cpu", 1)
    assert "pool train: 1 node(s) x 2 cpu worker(s), 1 thread(s) each: actor, reference" in text
    assert "pool rollout: 1 node(s) x 2 cpu worker(s), 1 thread(s) each: rollout" in text
    assert "vLLM tp 1 x 2 engine(s) on pool 'rollout'" in text and "sent per actor rank" in text


def test_memory_estimate_keeps_vllm_off_the_actor_pool():
    from megarl.config.memory import job_memory_estimate

    with_pool = job_memory_estimate(cfg("resources.device_memory_gb=10"), 10 * 10**9)
    colocated = job_memory_estimate(cfg("rollout.pool=null", "resources.pools.rollout.devices_per_node=1",
                                        "resources.device_memory_gb=10"), 10 * 10**9)
    assert with_pool.rollout_bytes == 0 and colocated.rollout_bytes == 5 * 10**9
    assert with_pool.megatron_bytes == colocated.megatron_bytes
