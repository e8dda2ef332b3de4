"""Run megatron-core on CPU: every redirect megarl needs, in one module, active only when CUDA is absent.

megatron-core 0.16.1 hard-codes CUDA in places that have nothing to do with the maths. On a machine without CUDA
(the CPU build of torch, gloo collectives) we redirect exactly those places and nothing else:

1. ``torch.cuda`` entry points megatron calls unconditionally (``current_device``, streams, events, ``synchronize``,
   ``empty_cache``, the CUDA RNG getters/setters). ``torch.cuda.is_available()`` and ``device_count()`` are left
   alone, so vLLM and everything else still see "no CUDA". See `_install_torch_cuda_shims`.
2. megatron-core's CUDA RNG helpers (``megatron/core/tensor_parallel/random.py``: ``_get_cuda_rng_state``,
   ``_set_cuda_rng_state``) and the tracker's ``torch.cuda.get_rng_state``/``manual_seed``: they act on a
   dedicated ``torch.Generator`` (`DEVICE_RNG`), not the default CPU generator, so the model-parallel RNG streams
   never mix with the default one (sharing it makes megatron warn "CPU RNG state changed within GPU RNG
   context").
3. Tensor factories called with ``device="cuda"`` / ``device=torch.cuda.current_device()`` (e.g.
   ``transformer/utils.py:get_default_causal_mask``, ``utils.py:GlobalMemoryBuffer.get_tensor``, rotary
   ``inv_freq``, ``distributed/param_and_grad_buffer.py`` buffers, ``optimizer/distrib_optimizer.py`` shard
   buffers), ``Tensor.cuda()``, ``Tensor.to("cuda")``, ``pin_memory=True``, and ``Tensor.type()`` strings that
   the distributed optimizer compares with ``'torch.cuda.FloatTensor'`` (``distrib_optimizer.py``
   ``_build_model_and_main_param_groups``). A `torch.overrides.TorchFunctionMode` rewrites these. It costs a
   Python call per torch op, so it is *scoped*: `megatron_on_cpu()` is entered around Megatron work (building a
   role, running its schedules) and left while vLLM or the controller run.

4. The MoE alltoall token dispatcher's split sizes (``transformer/moe/moe_utils.py`` ``maybe_move_tensor_to_cpu``
   converts only CUDA tensors to numpy): see `_install_moe_split_sizes_on_cpu`.

5. Backward passes of megatron's autograd functions (``tensor_parallel/mappings.py``, ``tensor_parallel/layers.py``,
   ``transformer/moe/moe_utils.py``: e.g. ``_AllToAll`` allocates its all-to-all-v output, and
   ``LinearWithGradAccumulationAndAsyncCommunication`` its sequence-parallel gather buffer, with
   ``device=torch.cuda.current_device()``): autograd runs a
   Function's backward without the caller's function mode, so each one's backward enters `megatron_on_cpu()`
   itself. See `_install_backward_mode_for_mappings`.

6. Uneven gathers/reduce-scatters over a TP group (``tensor_parallel/mappings.py`` ``_gather_along_first_dim`` /
   ``_reduce_scatter_along_first_dim`` with split sizes, used by the MoE alltoall dispatcher at expert-TP > 1):
   gloo's all_gather needs equal sizes ("ProcessGroupGloo::allgather: invalid tensor size") and has no list
   reduce-scatter; done as a padded all_gather, and as an all_reduce keeping this rank's rows. See
   `_install_uneven_tp_collectives`.

7. Linear layers whose call communicates nothing (``tensor_parallel/layers.py``
   ``linear_with_grad_accumulation_and_async_allreduce`` / ``linear_with_frozen_weight`` without all-reduce of the
   input gradient, sequence parallelism, gradient-accumulation fusion or a deferred weight gradient: every
   row-parallel linear, and column-parallel ones at TP1) run as native autograd ops instead of megatron's Python
   autograd Functions. Not a CUDA redirect but the CPU layer's cost: each such Function's backward runs in Python,
   every op of it through the function mode of item 3. The native ops are the Function's own forward
   (``matmul(input, weight.t())`` + bias); their backward is bit for bit the Function's (torch's mm backward for a
   transposed second operand computes ``grad_output.t() @ input``, megatron's weight-gradient GEMM). Measured at the
   0.6M-parameter `benchmarks/vs_trl.py` size on a 2-core AMD EPYC (AVX2): the actor's update ~68 -> ~63 ms. See
   `_install_native_linear_without_communication`.

Items 1, 2, 4, 5, 6 and 7 are process-wide but inert on real CUDA machines because `install()` does nothing when
``torch.cuda.is_available()``. Each redirect names the megatron-core 0.16.1 code that needs it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

_INSTALLED = False
_LOCK = threading.Lock()

# The "device" RNG on CPU: megatron's CUDA RNG tracker saves/restores/forks this generator's state.
DEVICE_RNG = torch.Generator(device="cpu")
DEVICE_RNG.manual_seed(0)


def cuda_available() -> bool:
    return torch.cuda.is_available()


# --------------------------------------------------------------------------------------------------------------
# 1 + 2. torch.cuda shims (process-wide, only without CUDA)
# --------------------------------------------------------------------------------------------------------------
class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: DDP (``distributed_data_parallel.py``) creates a communication stream
    and ``param_and_grad_buffer.py`` enters it / waits on it; on CPU all work is synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NullEvent":
        return event or _NullEvent()

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stand-in for ``torch.cuda.Event`` (used by megatron timers and the optimizer's overlap code)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


_NULL_STREAM = _NullStream()


def _install_torch_cuda_shims() -> None:
    cuda = torch.cuda
    # tensor_parallel/layers.py, utils.py, param_and_grad_buffer.py, distrib_optimizer.py, rotary embeddings:
    # `device=torch.cuda.current_device()`. Index 0 of "cuda"; the function mode maps it to CPU.
    cuda.current_device = lambda: 0
    # distributed_data_parallel.py / param_and_grad_buffer.py: communication streams and synchronize calls.
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.current_stream = lambda device=None: _NULL_STREAM
    cuda.default_stream = lambda device=None: _NULL_STREAM
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # tensor_parallel/random.py CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed: the CUDA RNG.
    cuda.get_rng_state = lambda device="cuda": DEVICE_RNG.get_state()
    cuda.set_rng_state = lambda new_state, device="cuda": DEVICE_RNG.set_state(new_state)
    cuda.manual_seed = lambda seed: DEVICE_RNG.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: DEVICE_RNG.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state


def _install_megatron_rng_redirect() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # megatron/core/tensor_parallel/random.py `_get_cuda_rng_state` reads torch.cuda.default_generators[idx],
    # `_set_cuda_rng_state` writes it through torch.cuda._lazy_call: both need a CUDA device.
    def _get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return DEVICE_RNG.get_state()

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        DEVICE_RNG.set_state(new_state)

    mrandom._get_cuda_rng_state = _get_state
    mrandom._set_cuda_rng_state = _set_state


def _install_moe_split_sizes_on_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # megatron/core/transformer/moe/moe_utils.py `maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA
    # tensors; the alltoall token dispatcher (`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`) relies on it
    # to turn its split sizes into host numbers, so on CPU they stay tensors and
    # `torch.distributed.all_to_all_single(output_split_sizes=<tensor>)` raises "TypeError: all_to_all_single():
    # incompatible function arguments". A CPU tensor asked for as numpy becomes numpy, as a CUDA one would.
    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move
    token_dispatcher.maybe_move_tensor_to_cpu = move


def _install_backward_mode_for_mappings() -> None:
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer.moe import moe_utils

    seen: set = set()
    for cls in (getattr(m, n) for m in (mappings, layers, moe_utils) for n in dir(m)):
        if not isinstance(cls, type) or cls in seen:
            continue
        seen.add(cls)
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function) and "backward" in cls.__dict__):
            continue
        original = cls.__dict__["backward"].__func__

        def backward(ctx, *grads, _original=original):
            with megatron_on_cpu():
                return _original(ctx, *grads)

        cls.backward = staticmethod(backward)


def _install_native_linear_without_communication() -> None:
    from megatron.core.tensor_parallel import layers

    def native_when_nothing_communicates(original, bias_gets_grad: bool):
        # `ColumnParallelLinear._forward_impl` / `RowParallelLinear._forward_impl` call these with keywords and
        # look the names up in `layers` at each call; positional extras (another caller) keep megatron's Function.
        # `LinearWithFrozenWeight` adds the bias inside the Function and returns no gradient for it: detached here.
        # `functools.wraps` carries the original's attributes: it reads and sets its `.warned` through the module name
        @functools.wraps(original)
        def linear(input, weight, bias=None, *args, **kwargs):
            if (args or kwargs.get("gradient_accumulation_fusion") or kwargs.get("allreduce_dgrad")
                    or kwargs.get("sequence_parallel") or kwargs.get("grad_output_buffer") is not None):
                return original(input, weight, bias, *args, **kwargs)
            output = torch.matmul(input, weight.t())
            if bias is None:
                return output
            return output + (bias if bias_gets_grad else bias.detach())

        return linear

    layers.linear_with_grad_accumulation_and_async_allreduce = native_when_nothing_communicates(
        layers.linear_with_grad_accumulation_and_async_allreduce, bias_gets_grad=True)
    layers.linear_with_frozen_weight = native_when_nothing_communicates(layers.linear_with_frozen_weight,
                                                                        bias_gets_grad=False)


def _install_uneven_tp_collectives() -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def uneven_gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    def uneven_reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(sizes[: dist.get_rank(group)])
        return total[start: start + sizes[dist.get_rank(group)]].contiguous()

    mappings._gather_along_first_dim = uneven_gather
    mappings._reduce_scatter_along_first_dim = uneven_reduce_scatter


# --------------------------------------------------------------------------------------------------------------
# 3. The scoped function mode
# --------------------------------------------------------------------------------------------------------------
_CPU = torch.device("cpu")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # An int device (e.g. `device=torch.cuda.current_device()`) means a CUDA ordinal; bools are not devices.
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_STRINGS = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
}


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D401 - torch protocol
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=_CPU)
        if kwargs.get("pin_memory"):
            # `utils.py` packed-seq helpers and offloading ask for pinned host memory, which needs CUDA.
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and "dtype" not in kwargs:
            # optimizer/distrib_optimizer.py compares `param.type()` with 'torch.cuda.FloatTensor' etc.
            name = func(*args, **kwargs)
            return _CUDA_TYPE_STRINGS.get(name, name)
        return func(*args, **kwargs)


def install() -> bool:
    """Install the process-wide shims (items 1 and 2) when CUDA is absent. Idempotent.

    Returns True when the CPU layer is active, False on CUDA machines (where nothing is changed).
    """
    global _INSTALLED
    if cuda_available():
        return False
    with _LOCK:
        if not _INSTALLED:
            _install_torch_cuda_shims()
            _install_megatron_rng_redirect()
            _install_moe_split_sizes_on_cpu()
            _install_backward_mode_for_mappings()
            _install_uneven_tp_collectives()
            _install_native_linear_without_communication()
            _INSTALLED = True
    return True


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Scope for Megatron work. On CUDA machines a no-op; on CPU installs the shims and enters `CudaToCpuMode`.

    Re-entrant: nesting does not stack a second mode.
    """
    if not install():
        yield
        return
    if in_megatron_scope():
        yield
        return
    with CudaToCpuMode():
        yield


def in_megatron_scope() -> bool:
    """True inside `megatron_on_cpu()` on a CPU machine (the CUDA->CPU function mode is on this thread's torch
    function-mode stack); always False on CUDA machines, where the scope changes nothing."""
    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


def require_outside_megatron_scope(what: str) -> None:
    """Raise RuntimeError when `what` (e.g. "rollout engine generate") is called inside `megatron_on_cpu()`.

    vLLM must not run under the CUDA->CPU function mode: the mode would rewrite vLLM's own device logic and add a
    Python call per op. The rollout adapter calls this at each entry point, to fail loudly instead of misbehaving."""
    if in_megatron_scope():
        raise RuntimeError(f"{what} called inside megatron_on_cpu(): leave that scope before using vLLM (enter it "
                           "only around Megatron work)")


def on_megatron_device(fn):
    """Decorator: run `fn` inside `megatron_on_cpu()` (a no-op on CUDA)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with megatron_on_cpu():
            return fn(*args, **kwargs)

    return wrapper
