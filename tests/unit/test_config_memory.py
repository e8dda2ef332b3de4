"""Pre-flight per-GPU memory estimate (megarl/config/memory.py): hand-computed cases, the refusal message, the
dry-run printout, and the minimum-GPU search. Expected numbers are written out as arithmetic below, from the byte
counts of the parts (bf16 param 2 B, fp32 grad 4 B, fp32 master 4 B + Adam m 4 B + v 4 B), not from the module."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import ConfigError, load_config
from megarl.config.memory import check_fits, estimate_memory, job_memory_estimate, min_gpus

GB = 10**9
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "yaml_configs" / "cpu_quickstart.yaml")
# Llama-2-7B's shape (HF config.json of meta-llama/Llama-2-7b-hf); its published parameter count is 6,738,415,616.
LLAMA2_7B = [
    "model.arch.num_layers=32", "model.arch.hidden_size=4096", "model.arch.num_attention_heads=32",
    "model.arch.num_query_groups=32", "model.arch.head_dim=128", "model.arch.ffn_hidden_size=11008",
    "model.arch.vocab_size=32000", "model.arch.max_position_embeddings=4096", "model.dtype=bf16",
]
LLAMA2_7B_PARAMS = 6_738_415_616


def test_7b_tp1_does_not_fit_one_h200():
    est = estimate_memory(7 * 10**9, dtype="bf16", tp=1, pp=1, dp=1, gpu_memory_utilization=0.5,
                          device_bytes=141 * GB)
    assert est.params_bytes == 7 * 2 * GB          # 7e9 x 2 B (bf16)
    assert est.grads_bytes == 7 * 4 * GB           # 7e9 x 4 B (fp32 grads)
    assert est.optimizer_bytes == 7 * 12 * GB      # 7e9 x (4 master + 4 m + 4 v) B, dp = 1
    assert est.megatron_bytes == 126 * GB          # 14 + 28 + 84
    assert est.rollout_bytes == 70.5 * GB          # 0.5 x 141
    assert est.total_bytes == 196.5 * GB and est.fits is False
    with pytest.raises(ConfigError) as e:
        check_fits(est)
    msg = str(e.value)
    assert msg.startswith("the layout does not fit in GPU memory: estimated 196.50 GB per GPU > 141.00 GB")
    assert "params 14.00 + grads 28.00 + optimizer 84.00" in msg and "70.50 GB left for Megatron" in msg


def test_7b_tp2_dp4_with_reference_fits_80gb():
    est = estimate_memory(7 * 10**9, dtype="bf16", tp=2, pp=1, dp=4, gpu_memory_utilization=0.5,
                          other_roles=((7 * 10**9, "bf16", 2, 1),), device_bytes=80 * GB)
    # shard = 7e9 / 2 = 3.5e9 params
    assert est.params_bytes == 7 * GB               # 3.5e9 x 2
    assert est.grads_bytes == 14 * GB               # 3.5e9 x 4 (full grad buffer, not DP-sharded)
    assert est.optimizer_bytes == 10.5 * GB         # 3.5e9 x 12 / 4
    assert est.other_roles_bytes == 7 * GB          # reference: 7e9 / 2 x 2
    assert est.total_bytes == 78.5 * GB             # 7 + 14 + 10.5 + 7 + 0.5 x 80
    assert est.fits is True
    check_fits(est)  # no error


def test_fp32_params_are_their_own_master_copy():
    est = estimate_memory(10**9, dtype="fp32", tp=1, pp=2, dp=2, gpu_memory_utilization=0.3)
    assert est.params_bytes == 2 * GB               # 1e9 / 2 x 4
    assert est.grads_bytes == 2 * GB                # 1e9 / 2 x 4
    assert est.optimizer_bytes == 2 * GB            # 0.5e9 x (m 4 + v 4) B / dp 2
    assert est.device_bytes is None and est.total_bytes is None and est.fits is None
    check_fits(est)  # unknown device memory: never refuses


def test_job_estimate_of_llama2_7b_config_refuses_on_a_small_gpu():
    cfg = load_config(QUICKSTART, LLAMA2_7B)  # actor TP2 (bf16), reference TP2, rollout util 0.5
    shard = LLAMA2_7B_PARAMS / 2
    est = job_memory_estimate(cfg, device_bytes=80 * GB)
    assert est.params_bytes == int(shard * 2) and est.grads_bytes == int(shard * 4)
    assert est.optimizer_bytes == int(shard * 12)   # dp 1
    assert est.other_roles_bytes == int(shard * 2)  # reference at TP2
    with pytest.raises(ConfigError, match=r"estimated 107\.38 GB per GPU > 80\.00 GB"):
        # 3,369,207,808 x (2 + 4 + 12 + 2) B = 67.38 GB, + 0.5 x 80 GB vLLM = 107.38 GB
        check_fits(est)


def test_dry_run_prints_the_estimate_without_refusing_when_memory_is_unknown(capsys):
    # resources.device=cuda on a machine without CUDA: the device memory is unknown, so it prints only
    assert main(["train", QUICKSTART, *LLAMA2_7B, "resources.device=cuda", "--dry-run"]) == 0
    out = capsys.readouterr().out
    section = out.split("# memory per GPU")[1].split("# placement")[0]
    assert re.search(r"actor params +6\.74 GB", section)          # 3,369,207,808 x 2 B
    assert re.search(r"optimizer state +40\.43 GB", section)      # 3,369,207,808 x 12 B
    assert "0.50 x device memory (device memory unknown)" in section


def test_min_gpus_by_hand():
    # bf16 with a reference: (2 + 4 + 12 + 2) B = 20 B per param over tp = n GPUs; vLLM takes half of the device.
    # 7e9 x 20 B = 140 GB: 80 GB GPU leaves 40 -> n = 4 (35 GB); 141 GB GPU leaves 70.5 -> n = 2 (70 GB)
    assert min_gpus(7 * 10**9, 80 * GB) == 4
    assert min_gpus(7 * 10**9, 141 * GB) == 2
    # without reference, 18 B: 0.5e9 -> 9 GB fits one 80 GB GPU
    assert min_gpus(5 * 10**8, 80 * GB, reference=False) == 1
    assert min_gpus(10**12, 80 * GB, max_gpus=8) is None


def test_dry_run_refuses_with_the_numbers_when_device_memory_is_given(capsys):
    assert main(["train", QUICKSTART, *LLAMA2_7B, "resources.device_memory_gb=80", "--dry-run"]) == 2
    err = capsys.readouterr().err
    # 67.38 GB Megatron (see above) + 0.5 x 80 GB vLLM
    assert err.startswith(
        "megarl: error: the layout does not fit in GPU memory: estimated 107.38 GB per GPU > 80.00 GB")
    # the same job fits a 141 GB GPU: 67.38 + 70.5 = 137.88 GB
    assert main(["train", QUICKSTART, *LLAMA2_7B, "resources.device_memory_gb=141", "--dry-run"]) == 0
    assert re.search(r"total +137\.88 GB of 141\.00 GB", capsys.readouterr().out)


def test_trainer_run_refuses_before_ray_starts(tmp_path):
    import ray

    from megarl import trainer

    cfg = load_config(QUICKSTART, [*LLAMA2_7B, "resources.device_memory_gb=80", f"logging.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"estimated 107\.38 GB per GPU > 80\.00 GB"):
        trainer.run(cfg)
    assert not ray.is_initialized()


def test_dry_run_counts_the_judge_pool_and_refuses_a_judge_that_does_not_fit(tmp_path, capsys):
    """reward.judge: --dry-run prints the judge pool's memory (vLLM's share, the judge's weight files / judge tp)
    and its engine ranks; a shard at or above vLLM's share of a known device is refused, naming the numbers."""
    judge_dir = tmp_path / "judge"
    judge_dir.mkdir()
    with open(judge_dir / "model.safetensors", "wb") as f:  # 3 GB of weights (sparse)
        f.truncate(3 * GB)
    judge = ["resources.pools.judge={nodes: 1, devices_per_node: 2}", f"reward.judge.model={judge_dir}",
             "reward.judge.pool=judge", "resources.device_memory_gb=141", *LLAMA2_7B]
    assert main(["train", QUICKSTART, *judge, "reward.judge.tp=2", "rollout.tp=1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    section = out.split("# memory per GPU of the judge pool 'judge'")[1].split("#")[0]
    assert "vLLM              70.50 GB (0.50 x 141.00 GB)" in section  # the judge pool's share of 141 GB
    assert re.search(r"of which weights +1\.50 GB +\(the judge's weight files / reward\.judge\.tp 2\)", section)
    table = out.split("# placement")[1]
    assert len(re.findall(r"^judge +\d+ +0 +cpu", table, flags=re.M)) == 2  # ranks 2 and 3, after the default pool
    assert re.search(r"^judge +3 +0 +cpu +1 +- +0 ", table, flags=re.M)  # the second is TP rank 1 of engine 0
    # 3 GB at tp 1 on a 5 GB device: 3 >= 0.5 x 5 = 2.5 GB of vLLM
    assert main(["train", QUICKSTART, *judge[:-len(LLAMA2_7B)], "resources.device_memory_gb=5", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "reward.judge: the judge's weights do not fit its engines' memory: 3.00 GB per device" in err
    assert "vLLM's share 2.50 GB" in err and "raise reward.judge.tp" in err


# PEFT's count for LoRA r=16 on q, k, v, o, gate, up, down of Llama-2-7B (`print_trainable_parameters`): 39,976,960;
# megarl's fused linears share one A for q/k/v (saves 2 x 16 x 4096 per layer) and for gate/up (16 x 4096)
LORA16_PARAMS = 39_976_960 - 32 * (2 * 16 * 4096 + 16 * 4096)


def test_lora_estimate_counts_adapters_only_and_no_reference():
    cfg = load_config(QUICKSTART, [*LLAMA2_7B, "actor.lora.rank=16"])  # actor TP2 bf16, reference TP2 enabled
    shard, adapters = LLAMA2_7B_PARAMS / 2, LORA16_PARAMS / 2
    est = job_memory_estimate(cfg, device_bytes=80 * GB)
    assert est.params_bytes == int(shard * 2) + int(adapters * 2)
    assert est.grads_bytes == int(adapters * 4) and est.optimizer_bytes == int(adapters * 12)
    assert est.other_roles_bytes == 0  # the reference is the actor's base with the adapters off
    full = int(shard * 2) + int(shard * 4) + int(shard * 12) + int(shard * 2)
    assert est.lora_saved_bytes == full - est.megatron_bytes
    assert "LoRA saves" in est.describe()


def test_lora_config_refusals():
    with pytest.raises(ConfigError, match="experts"):
        load_config(QUICKSTART, ["actor.lora.targets=[qkv,experts]"])
    with pytest.raises(ConfigError, match="unknown target 'mlp'"):
        load_config(QUICKSTART, ["actor.lora.targets=[mlp]"])
