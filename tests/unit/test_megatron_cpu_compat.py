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
