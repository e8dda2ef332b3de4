"""Mixture-of-experts on CUDA: megatron-core's MoE layer (Transformer Engine grouped GEMM when TE is installed,
SequentialMLP otherwise) with the alltoall token dispatcher over NCCL, loaded from a transformers Qwen3-MoE.

The reference is transformers' own forward of the same checkpoint on the same GPU (fp32, TF32 off). With two or
more GPUs the experts are split over an expert-parallel group of 2 (alltoall across ranks); with one, EP is 1 and
the dispatcher still runs its permute/unpermute path on the device.
"""

import pytest
import torch

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.gpu

SEQ = 24


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _moe_engine_on_gpu(rank, world, hf_dir, dtype):
    from megarl.algorithms.log_probs import vocab_parallel_log_probs
    from megarl.checkpoint.engine_io import load_hf_into_engine
    from megarl.engine.megatron_engine import MegatronEngine, OptimizerSettings
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology

    torch.backends.cuda.matmul.allow_tf32 = False
    spec = ModelSpec.from_hf_dir(hf_dir)
    groups = build_role_groups(RoleTopology(dp=world, ep=world))
    engine = MegatronEngine(spec, groups, dtype=dtype, optimizer=OptimizerSettings(lr=1e-3), init_weights=False)
    load_hf_into_engine(engine, hf_dir)
    start, _ = engine.vocab_shard()
    tokens = _tokens(spec.vocab_size)

    def loss_fn(logits, batch):
        assert logits.is_cuda == torch.cuda.is_available()
        t = batch["input_ids"].to(logits.device)
        logp = vocab_parallel_log_probs(logits[:, :-1], t[:, 1:], groups.pgs.tp, start)
        count = torch.tensor(logp.numel(), dtype=torch.int, device=logits.device)
        return -logp.sum(), count, {"loss": -logp.mean().detach(), "log_probs": logp.detach().float().cpu()}

    first = engine.run([{"input_ids": tokens}], loss_fn, forward_only=True)[0]["log_probs"]
    losses = []
    for _ in range(3):
        out = engine.run([{"input_ids": tokens}], loss_fn, forward_only=False)
        engine.step()
        losses.append(float(out[0]["loss"]))
    experts = type(engine.module.decoder.layers[0].mlp.experts).__name__
    dispatcher = type(engine.module.decoder.layers[0].mlp.token_dispatcher).__name__
    return {"log_probs": first, "losses": losses, "experts": experts, "dispatcher": dispatcher}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from megarl.checkpoint.tiny import make_hf_model

    return make_hf_model("qwen3_moe", str(tmp_path_factory.mktemp("moe") / "qwen3_moe"), seed=1)


def _hf_log_probs(hf_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda()
    tokens = _tokens(model.config.vocab_size).cuda()
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens).logits.float(), -1)
    return lp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0].cpu()


def test_moe_fp32_log_probs_match_transformers_on_gpu(moe_dir):
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(world, _moe_engine_on_gpu, moe_dir, "fp32", timeout_s=300)
    ref = _hf_log_probs(moe_dir)
    for r in results:
        print(f"experts {r['experts']}, dispatcher {r['dispatcher']}, ep {world}, "
              f"max |log-prob diff| {float((r['log_probs'] - ref).abs().max()):.2e}")
        torch.testing.assert_close(r["log_probs"], ref, atol=1e-4, rtol=0)
        assert r["losses"][-1] < r["losses"][0]


def test_moe_bf16_trains_on_gpu(moe_dir):
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(world, _moe_engine_on_gpu, moe_dir, "bf16", timeout_s=300)
    for r in results:
        assert "alltoall" in r["dispatcher"].lower(), r["dispatcher"]
        assert r["losses"][-1] < r["losses"][0], r["losses"]
