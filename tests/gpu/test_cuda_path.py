"""The CUDA path: the CPU compatibility layer stays out of the way and a MegatronEngine trains on the GPU."""

import pytest
import torch

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.gpu


def test_cpu_layer_is_inactive_on_cuda():
    from megarl.platform import megatron_cpu_compat as compat

    current_device = torch.cuda.current_device
    with compat.megatron_on_cpu():
        assert not compat.in_megatron_scope()
        assert torch.ones(1, device="cuda").is_cuda
    assert torch.cuda.current_device is current_device
    assert compat.install() is False


def _train_on_gpu(rank, world_size, dtype):
    from megarl.algorithms.log_probs import vocab_parallel_log_probs
    from megarl.engine.megatron_engine import MegatronEngine, OptimizerSettings
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=2, hidden_size=256, num_attention_heads=4,
                     num_query_groups=2, head_dim=64, ffn_hidden_size=512, vocab_size=1000, max_position_embeddings=128)
    groups = build_role_groups(RoleTopology(tp=world_size))
    engine = MegatronEngine(spec, groups, dtype=dtype, optimizer=OptimizerSettings(lr=1e-3))
    start, _ = engine.vocab_shard()
    tokens = torch.randint(0, spec.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits, batch):
        assert logits.is_cuda
        t = batch["input_ids"].to(logits.device)
        logp = vocab_parallel_log_probs(logits[:, :-1], t[:, 1:], groups.pgs.tp, start)
        count = torch.tensor(logp.numel(), dtype=torch.int, device=logits.device)
        return -logp.sum(), count, {"loss": -logp.mean().detach()}

    losses = []
    for _ in range(3):
        out = engine.run([{"input_ids": tokens}], loss_fn, forward_only=False)
        engine.step()
        losses.append(float(out[0]["loss"]))
    return losses, next(engine.module.parameters()).dtype


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_trains_on_gpu(dtype):
    world = min(torch.cuda.device_count(), 2)
    results = run_ranks(world, _train_on_gpu, dtype, timeout_s=600)
    losses, param_dtype = results[0]
    assert losses[-1] < losses[0]
    assert param_dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)


def test_delta_unpack_moves_a_cuda_payload_onto_a_host_target():
    """Delta mode with a CUDA workspace and a host staging tensor: index_put_ needs indices/values on the target's
    device (megarl.reshard.delta.unpack moves them)."""
    from megarl.reshard.delta import SPARSE, unpack

    target = torch.zeros(3, 4)
    unpack(target, SPARSE, torch.tensor([1.0, 2.0], device="cuda"),
           torch.tensor([1, 10], dtype=torch.int32, device="cuda"))
    assert target[0, 1].item() == 1.0 and target[2, 2].item() == 2.0 and float(target.sum()) == 3.0
