"""The megatron-core CPU layer: CUDA placements become CPU inside the scope only; the RNG tracker gets its own
generator. (On CUDA machines the layer is inactive: see tests/gpu/test_cuda_path.py.)"""

import logging

import pytest
import torch

from megarl.platform import megatron_cpu_compat as compat

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU compatibility layer is inactive where CUDA exists (tests/gpu covers it)"
)


def test_factories_and_moves_land_on_cpu_inside_the_scope():
    with compat.megatron_on_cpu():
        a = torch.ones(3, device="cuda")
        b = torch.empty(2, 2, device=torch.cuda.current_device())
        c = torch.arange(4, device=torch.device("cuda", 0))
        d = torch.zeros(2).cuda()
        e = torch.zeros(2).to("cuda")
        f = torch.tensor([1.0], pin_memory=True)
    assert {t.device.type for t in (a, b, c, d, e, f)} == {"cpu"}


def test_type_strings_report_cuda_only_inside_the_scope():
    t = torch.zeros(2)
    with compat.megatron_on_cpu():
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # conversions still work
    assert t.type() == "torch.FloatTensor"


def test_scope_is_reentrant_and_leaves_no_mode_behind():
    with compat.megatron_on_cpu():
        with compat.megatron_on_cpu():
            assert compat.in_megatron_scope()
        assert compat.in_megatron_scope()
    assert not compat.in_megatron_scope()
    with pytest.raises((RuntimeError, AssertionError, TypeError)):
        torch.ones(1, device="cuda")  # outside the scope CUDA placements still fail loudly


def test_cuda_availability_is_not_faked():
    with compat.megatron_on_cpu():
        assert torch.cuda.is_available() is False
        assert torch.cuda.device_count() == 0


def test_rng_tracker_uses_its_own_generator(caplog):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    with compat.megatron_on_cpu():
        model_parallel_cuda_manual_seed(42, force_reset_rng=True, tp_rank=1, ep_rank=0, etp_rank=1)
        tracker = get_cuda_rng_tracker()
        default_before = torch.get_rng_state()
        outside = compat.DEVICE_RNG.get_state()
        with caplog.at_level(logging.WARNING):
            with tracker.fork():
                inside = compat.DEVICE_RNG.get_state()
                torch.randn(4, generator=compat.DEVICE_RNG)  # advances the tracked stream
        assert not torch.equal(inside, outside), "fork did not switch the device generator to the tracked state"
        assert torch.equal(compat.DEVICE_RNG.get_state(), outside), "fork did not restore the device generator"
        assert torch.equal(torch.get_rng_state(), default_before), "the default CPU generator was touched"
        with tracker.fork():
            again = compat.DEVICE_RNG.get_state()
        assert not torch.equal(again, inside), "the tracked stream did not advance across forks"
    assert "CPU RNG state changed" not in caplog.text


def _linear_case(bias: bool, weight_grad: bool = True):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(13, 3, 24, generator=g, requires_grad=True)  # [s, b, h], megatron's layout
    w = torch.randn(40, 24, generator=g, requires_grad=weight_grad)  # [out, h]
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    return x, w, b, torch.randn(13, 3, 40, generator=g)


def _output_and_grads(y, grad_output, inputs):
    return [y, *torch.autograd.grad(y, [t for t in inputs if t is not None and t.requires_grad], grad_output)]


@pytest.mark.parametrize("bias", [False, True])
def test_a_linear_that_communicates_nothing_runs_native_ops_bit_identical_to_megatrons_function(bias):
    """Item 7: megatron's own autograd Function is the expected value (called directly, as the unpatched
    `linear_with_grad_accumulation_and_async_allreduce` does); the redirected call must give the same output and
    gradients bit for bit while no Python backward of megatron's is on the graph."""
    compat.install()
    from megatron.core.tensor_parallel import layers

    x, w, b, grad = _linear_case(bias)
    with compat.megatron_on_cpu():
        expected = _output_and_grads(layers.LinearWithGradAccumulationAndAsyncCommunication.apply(
            x, w, b, False, False, False, None, 0, None), grad, (x, w, b))
        y = layers.linear_with_grad_accumulation_and_async_allreduce(  # the keywords ColumnParallelLinear passes
            input=x, weight=w, bias=b, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None)
        got = _output_and_grads(y, grad, (x, w, b))
    assert "LinearWith" not in type(y.grad_fn).__name__, type(y.grad_fn).__name__
    assert len(got) == len(expected) == 3 + bias
    for e, r in zip(expected, got):
        assert torch.equal(e, r)


def test_a_frozen_linear_that_communicates_nothing_runs_native_ops_bit_identical_to_megatrons_function():
    compat.install()
    from megatron.core.tensor_parallel import layers

    x, w, b, grad = _linear_case(bias=True, weight_grad=False)
    with compat.megatron_on_cpu():
        y_expected = layers.LinearWithFrozenWeight.apply(x, w, b, False, None)
        expected = _output_and_grads(y_expected, grad, (x,))
        y = layers.linear_with_frozen_weight(  # the keywords RowParallelLinear passes
            input=x, weight=w, bias=b, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=None, grad_output_buffer=None)
        got = _output_and_grads(y, grad, (x,))
        # megatron's Function gives the bias no gradient (it adds it inside the Function): neither may the redirect
        with pytest.raises(RuntimeError, match="not have been used"):
            torch.autograd.grad(y, [b], grad)
    assert "LinearWith" not in type(y.grad_fn).__name__
    for e, r in zip(expected, got):
        assert torch.equal(e, r)
