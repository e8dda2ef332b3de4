"""The job configuration: one frozen dataclass per component.

YAML only serialises these classes (`megarl.config.loader`); cross-field rules live in
`megarl.config.validate`. Every field is declared with `opt(...)`, whose `help` states meaning and unit; the
default is the field's default. `docs/config.md` is generated from this metadata (`python -m megarl.config.docs`).

Batch-size vocabulary (used consistently below):
  prompt  - one row of the dataset.
  sample  - one prompt plus one sampled response; a step has `prompts_per_step * samples_per_prompt` samples.
  global  - counted over the whole job (all DP ranks together).
  per DP rank - counted on one data-parallel replica (every TP/PP/CP rank of that replica sees the same samples).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from megarl.models.spec import SUPPORTED_ARCHITECTURES

MISSING = dataclasses.MISSING

Dtype = Literal["fp32", "bf16", "fp16"]
Architecture = Literal[SUPPORTED_ARCHITECTURES]  # the one table lives in megarl.models.spec


def opt(
    default: Any = MISSING, help: str = "", *, factory: Any = None, unit: str = "", min: float | None = None
) -> Any:
    """Declare a config field: `help` = meaning, `unit` = unit of the value, `min` = smallest allowed value."""
    if not help:
        raise TypeError("every config field needs a help text")
    metadata = {"help": help, "unit": unit, "min": min}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# --------------------------------------------------------------------------------------------------- model


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchConfig:
    """Architecture of a decoder-only transformer, for random-init models without a HF checkpoint.

    The same numbers are read from a checkpoint's config.json when `model.path` is used
    (`megarl.config.arch.resolve_arch`).
    """

    architecture: Architecture = opt(help="HF architecture name; picks bias/norm conventions (Qwen2: qkv bias).")
    num_layers: int = opt(help="Number of transformer layers (HF num_hidden_layers).", min=1)
    hidden_size: int = opt(help="Model width.", unit="features", min=1)
    num_attention_heads: int = opt(help="Number of query heads.", min=1)
    num_query_groups: int = opt(help="Number of key/value heads (GQA groups; HF num_key_value_heads).", min=1)
    head_dim: int = opt(help="Width of one attention head.", unit="features", min=1)
    ffn_hidden_size: int = opt(help="Width of the SwiGLU MLP (HF intermediate_size).", unit="features", min=1)
    vocab_size: int = opt(help="Vocabulary size of the embedding and output layer.", unit="tokens", min=1)
    max_position_embeddings: int = opt(
        help="Longest sequence (prompt + response) the model supports.", unit="tokens", min=1
    )
    tie_word_embeddings: bool = opt(False, "Share the input embedding with the output layer.")
    rope_theta: float = opt(10000.0, "Base of the rotary position embedding.")
    norm_eps: float = opt(
        1e-6, "Epsilon of RMSNorm (HF rms_norm_eps; 1e-6 is the HF default of every supported family)."
    )
    num_experts: int = opt(
        0, "Routed experts per MoE layer (HF num_experts / num_local_experts); 0 for dense architectures.", min=0
    )
    moe_topk: int = opt(0, "Experts each token is routed to (HF num_experts_per_tok); MoE only.", min=0)
    moe_ffn_hidden_size: int = opt(
        0, "SwiGLU width of one routed expert (HF moe_intermediate_size; Mixtral: intermediate_size); MoE only.",
        unit="features", min=0,
    )
    moe_norm_topk_prob: bool = opt(
        True, "Renormalise the top-k router probabilities to sum to 1 (HF norm_topk_prob; Mixtral always does)."
    )
    moe_layers: tuple[bool, ...] = opt(
        (), "Per layer, true where the MLP is a MoE block (HF decoder_sparse_step / mlp_only_layers); "
        "empty = every layer of a MoE architecture.",
    )
    shared_expert_ffn_hidden_size: int = opt(
        0, "Width of the gated shared expert (Qwen2-MoE shared_expert_intermediate_size); 0 = none.",
        unit="features", min=0,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model a role runs. Exactly one of `path` and `arch` is set."""

    path: Optional[str] = opt(
        None,
        "HuggingFace checkpoint directory. Its config.json gives the architecture (only config.json is read "
        "while validating; weights are loaded by the roles).",
    )
    arch: Optional[ArchConfig] = opt(None, "Inline architecture for a randomly initialised model (tests, quickstart).")
    tokenizer: Optional[str] = opt(None, "HF tokenizer directory or hub name; defaults to `path`.")
    dtype: Dtype = opt("bf16", "Parameter and compute dtype of the Megatron model and the rollout engine.")


# --------------------------------------------------------------------------------------------------- resources


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """A resource pool: a block of devices that one or more roles are placed on (colocated roles share it)."""

    nodes: int = opt(1, "Number of nodes in the pool.", min=1)
    devices_per_node: int = opt(1, "Devices (GPUs, or CPU worker processes) used on each node.", min=1)


def _default_pools() -> dict[str, PoolConfig]:
    return {"default": PoolConfig()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourcesConfig:
    """Devices of the job, as named pools. Pools get consecutive global ranks in the order they are listed."""

    device: Literal["auto", "cuda", "cpu"] = opt("auto", "Device kind; auto = cuda when available, else cpu.")
    pools: dict[str, PoolConfig] = opt(factory=_default_pools, help="Named pools: name -> {nodes, devices_per_node}.")
    device_memory_gb: Optional[float] = opt(
        None, "Memory of one GPU for the pre-flight memory estimate (refuses layouts that exceed it); "
        "null = ask CUDA when present, else print the estimate only.", unit="GB (10^9 bytes)", min=0,
    )
    threads_per_worker: Optional[int] = opt(
        None, "CPU threads of each worker process (OMP_NUM_THREADS: torch intra-op, and vLLM's CPU kernels); "
        "null = this machine's cores / the device slots of all pools (at least 1), for a local Ray cluster, "
        "and 1 when joining a cluster (RAY_ADDRESS), whose nodes' cores the controller cannot see.", min=1,
    )
    heartbeat_timeout_s: float = opt(
        30.0, "How long a worker process may leave the controller's heartbeat unanswered while one of its calls runs "
        "before the call fails naming the rank, the call and the process (a stopped, frozen or unreachable process; "
        "a dead one is named at once). Calls themselves have no time limit while their ranks answer: a step, "
        "generation or save of any length is collected.", unit="s", min=0.1,
    )
    call_timeout_s: Optional[float] = opt(
        None, "Optional bound on the wall time of every controller call to the workers (generate, update, save, "
        "...), from its submission; null = none (heartbeat_timeout_s still catches hung ranks). Set it above your "
        "longest healthy call, e.g. one_step_off collects a generation after the training step it overlapped.",
        unit="s", min=1,
    )


# --------------------------------------------------------------------------------------------------- roles


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Megatron layout of one role. tp*pp*cp*dp must equal the device count of the role's pool."""

    tp: int = opt(1, "Tensor-parallel size (splits heads and MLP columns).", min=1)
    pp: int = opt(1, "Pipeline-parallel size (splits the layer stack into stages).", min=1)
    cp: int = opt(
        1, "Context-parallel size: each sequence is cut into 2*cp chunks, CP rank r computes chunks r and 2*cp-1-r "
        "(megatron's load-balanced split). With Transformer Engine its attention runs CP; without it (CPU) megarl's "
        "all-gather-KV attention does (megarl/models/context_parallel.py).", min=1)
    dp: Optional[int] = opt(None, "Data-parallel size; null = pool devices / (tp*pp*cp).", min=1)
    ep: int = opt(1, "Expert-parallel size for MoE layers (1 for dense models). etp*ep must divide tp*cp*dp: with "
                  "etp = tp it is carved out of dp*cp, with a smaller etp it may span TP ranks too.", min=1)
    etp: Optional[int] = opt(
        None, "Expert tensor-parallel size for MoE layers (megatron-core expert_tensor_parallel_size): each expert's "
        "FFN width is split over etp ranks; null = tp (megatron-core's default). The expert grid is etp fastest, "
        "then ep, then expert-dp over the tp*cp*dp ranks of a pipeline stage.", min=1)
    first_stage_layers: Optional[int] = opt(
        None, "Layers on the first pipeline stage for an uneven split; null = even split.", min=0
    )
    last_stage_layers: Optional[int] = opt(
        None, "Layers on the last pipeline stage for an uneven split; null = even split.", min=0
    )
    vpp: int = opt(
        1, "Virtual pipeline chunks per stage (megatron-core's virtual_pipeline_model_parallel_size; interleaved 1F1B "
        "schedule). The layers are cut into pp*vpp equal chunks; stage r holds chunks r, r+pp, ... Needs pp > 1, "
        "num_layers divisible by pp*vpp and an even split (no first/last_stage_layers); MoE models at tp > 1 only "
        "without router losses (aux_loss_coeff = z_loss_coeff = 0). "
        "Micro-batch counts that are not a multiple of pp are padded with empty micro-batches (megatron's "
        "schedule requires a multiple).", min=1)
    rank_order: Literal["natural", "reshard"] = opt(
        "natural", "Which rank holds which Megatron coordinate (actor only). natural = tp fastest, then cp, dp, pp; "
        "reshard = the order that minimises the most bytes any rank receives when resharding into rollout.tp's "
        "engines (megarl.reshard.rank_order; e.g. TP4 -> rollout TP2 halves it), TP groups kept inside a node.",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Megatron DistributedOptimizer settings of a trained role."""

    name: Literal["adam", "adamw"] = opt("adamw", "Optimizer; adam = L2 penalty in the gradient, adamw = decoupled.")
    lr: float = opt(1e-6, "Peak learning rate (reached after warmup).", min=0)
    min_lr: float = opt(0.0, "Final learning rate of the cosine schedule.", min=0)
    lr_schedule: Literal["constant", "cosine"] = opt("constant", "Learning-rate decay after warmup.")
    warmup_steps: int = opt(0, "Linear warmup length.", unit="optimizer steps", min=0)
    weight_decay: float = opt(0.01, "Weight decay coefficient.", min=0)
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam (beta1, beta2).")
    eps: float = opt(1e-8, "Adam epsilon.", min=0)
    clip_grad: float = opt(1.0, "Global gradient-norm clip; 0 disables clipping.", unit="L2 norm", min=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """What a role moves to host memory while it is idle (e.g. while the rollout engine runs)."""

    params: bool = opt(False, "Offload model parameters.")
    grads: bool = opt(False, "Offload gradient buffers.")
    optimizer: bool = opt(False, "Offload optimizer state.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleConfig:
    """A Megatron role that only runs forward passes (reference)."""

    enabled: bool = opt(True, "Build this role.")
    pool: str = opt("default", "Name of the resource pool the role runs on (a key of resources.pools).")
    parallel: ParallelConfig = opt(factory=ParallelConfig, help="Megatron parallel layout.")
    micro_batch_samples: Optional[int] = opt(
        None,
        "Samples per micro-batch, per DP rank. null = 1 unless micro_batch_tokens is set.",
        unit="samples per DP rank",
        min=1,
    )
    micro_batch_tokens: Optional[int] = opt(
        None,
        "Dynamic batching: pack samples into micro-batches of at most this many tokens, per DP rank "
        "(mutually exclusive with micro_batch_samples).",
        unit="tokens per DP rank",
        min=1,
    )
    offload: OffloadConfig = opt(factory=OffloadConfig, help="Host-memory offload while idle.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeTrainingConfig:
    """Mixture-of-experts training settings of a trained role (unused for dense models): megatron-core's router
    losses, added to the role's loss through the router's autograd (megarl.engine.moe)."""

    aux_loss_coeff: float = opt(
        0.0, "Weight of the switch load-balancing loss (E * sum_i f_i * P_i per micro-batch and MoE layer: f_i the "
        "fraction of routed slots, P_i the mean router probability of expert i); 0 = off. Reported unscaled as "
        "actor/moe_aux_loss. Per-token normalisation: each micro-batch's term is weighted by its token count and "
        "divided by the loss's units, as megatron-core does.", min=0,
    )
    z_loss_coeff: float = opt(
        0.0, "Weight of the router z-loss (mean logsumexp(router logits)^2); 0 = off. Reported as actor/moe_z_loss.",
        min=0,
    )
    token_dispatcher: Literal["alltoall", "allgather"] = opt(
        "alltoall", "megatron-core token dispatcher over the expert-parallel group (gloo on CPU, NCCL on GPU).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainedRoleConfig(RoleConfig):
    """A Megatron role with an optimizer (actor)."""

    optimizer: OptimizerConfig = opt(factory=OptimizerConfig, help="Optimizer and learning-rate schedule.")
    mini_batch_prompts: Optional[int] = opt(
        None,
        "Prompts per optimizer step, global (all their samples go into the mini-batch); must divide "
        "data.prompts_per_step. null = one optimizer step per RL step and PPO epoch.",
        unit="prompts, global",
        min=1,
    )
    moe: MoeTrainingConfig = opt(factory=MoeTrainingConfig, help="MoE router losses and token dispatcher.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA adapters on the actor's linears (megarl.engine.lora; docs/lora.md): the base weights are frozen, the
    optimizer holds the adapters only, checkpoints hold the adapters (and the base's path)."""

    rank: int = opt(8, "Rank r of each adapter (B @ A is [out, r] @ [r, in]).", min=1)
    alpha: float = opt(16.0, "Scaling numerator: the weight delta is (alpha / rank) * B @ A (PEFT's lora_alpha).",
                       min=0)
    dropout: float = opt(0.0, "Dropout probability on the adapters' input (training forwards only).", min=0)
    targets: tuple[str, ...] = opt(
        ("qkv", "proj", "fc1", "fc2"),
        "Adapted linears of every layer: qkv (fused q/k/v), proj (attention output), fc1 (fused gate/up), fc2 "
        "(down). Mixture-of-experts models: qkv, proj only (adapters on experts are not built).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorConfig(TrainedRoleConfig):
    """The policy being trained."""

    lora: Optional[LoraConfig] = opt(
        None, "LoRA adapters instead of full fine-tuning; null = full fine-tuning. With LoRA the reference "
        "log-probs come from the actor's own base weights with the adapters off (no reference model is built: "
        "reference.enabled only switches them on, on the actor's pool and layout).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticConfig(TrainedRoleConfig):
    """The value model (PPO / GAE). May run a different model than the actor."""

    enabled: bool = opt(False, "Build the critic (required by advantage_estimator=gae).")
    model: Optional[ModelConfig] = opt(None, "Model of the critic; null = the actor's model (top-level `model`).")
    value_clip: float = opt(0.2, "Clip range of the value loss around the old values; 0 disables.", min=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReferenceConfig(RoleConfig):
    """The frozen reference policy for the KL penalty; always the actor's model."""

    enabled: bool = opt(False, "Build the reference role (required when algorithm.kl.coef > 0).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelConfig(RoleConfig):
    """A learned reward model (sequence score from the last token). Rule-based rewards need no role."""

    enabled: bool = opt(False, "Build the reward-model role.")
    model: Optional[ModelConfig] = opt(None, "Model of the reward model; required when enabled.")


# --------------------------------------------------------------------------------------------------- rollout

# The one default bucket size of the weight reshard (also `megarl.reshard.executor.DEFAULT_BUCKET_BYTES`).
DEFAULT_RESHARD_BUCKET_MB = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Generation with vLLM: on the actor's devices (hybrid engine), or on a pool of their own (`pool`)."""

    pool: Optional[str] = opt(
        None, "Where the engines run: null = on the actor's pool (colocated, the hybrid engine: weights resharded "
        "in place, the engines sleep during training); a pool name of resources.pools = a pool of their own (the "
        "actor's shards are sent over a bridge group after every update; that pool hosts no Megatron role)."
    )
    tp: int = opt(1, "Tensor-parallel size of each vLLM engine; must divide the device count of the engines' pool "
                  "(the actor's, or rollout.pool).", min=1)
    ep: bool = opt(
        False, "vLLM expert parallelism for mixture-of-experts models (vLLM `enable_expert_parallel`): each of an "
        "engine's tp ranks holds num_experts/tp whole routed experts (vLLM's linear placement) instead of a 1/tp "
        "slice of every expert; attention stays tensor-parallel. The reshard plans for either layout."
    )
    samples_per_prompt: int = opt(1, "Responses sampled per prompt (the GRPO/RLOO group size).", min=1)
    temperature: float = opt(1.0, "Sampling temperature; 0 = greedy.", min=0)
    top_p: float = opt(1.0, "Nucleus sampling mass in (0, 1].", min=0)
    top_k: int = opt(-1, "Top-k sampling; -1 disables.", min=-1)
    max_new_tokens: int = opt(512, "Longest response.", unit="tokens", min=1)
    max_prompt_tokens: int = opt(512, "Longest prompt after the chat template.", unit="tokens", min=1)
    overlong_prompt: Literal["drop", "truncate", "error"] = opt(
        "drop", "What to do with prompts longer than max_prompt_tokens (truncate keeps the last tokens)."
    )
    stop: tuple[str, ...] = opt((), "Extra stop strings (EOS always stops unless ignore_eos).")
    ignore_eos: bool = opt(
        False, "Keep sampling after EOS until max_new_tokens (training rollouts only; validation stops at EOS): "
        "fixed-length responses for benchmarks that compare frameworks on equal work."
    )
    seed: int = opt(0, "Seed of the sampler.")
    gpu_memory_utilization: float = opt(
        0.5, "Fraction of GPU memory vLLM may use for weights and KV cache (GPU only).", unit="fraction", min=0
    )
    kv_cache_gib: float = opt(1.0, "KV-cache size on CPU (VLLM_CPU_KVCACHE_SPACE).", unit="GiB", min=0)
    enforce_eager: Literal["auto", "true", "false"] = opt(
        "auto", "vLLM eager mode (no CUDA graphs / compilation): auto = eager on CPU, CUDA graphs on GPU; true trades "
        "rollout speed for start-up time and memory. On CPU, false compiles the model (inductor, 15-40 s per "
        "engine at its first start; later starts of the same model and settings load vLLM's compile cache, "
        "~14 s at 0.7M parameters instead of 24-28) and decodes with less Python per token: worth it for runs "
        "longer than a few minutes (engines side by side in one process, one AVX2 core each, "
        "benchmarks/rollout_settings.py: a GRPO rollout 18-21% shorter at 0.7M parameters, 9% at 24M; "
        "benchmarks/results/rollout_settings.md)."
    )
    cpu_linear: Literal["vllm", "torch"] = opt(
        "vllm", "CPU only (ignored on GPU): the kernel of vLLM's unquantized linear layers. vllm = vLLM's choice "
        "(oneDNN on x86: a packed copy of each weight, rebuilt at every weight sync); torch = "
        "torch.nn.functional.linear on the weight as loaded (the kernel transformers uses), so a sync writes the "
        "engine's weights in place like on GPU, with no staging copy and no repacking. Which is faster depends on "
        "the shapes (benchmarks/rollout_settings.py, one AVX2 core per engine; benchmarks/results/"
        "rollout_settings.md): at 0.7M parameters torch (a sync of every weight 20 -> 0.3 ms in place; generation "
        "as fast eager, 9% slower compiled), at 24M vllm (oneDNN generates 18-22% faster; the sync's 98 vs 15 ms "
        "does not make up for it). "
        "Different kernels round differently: sampled tokens, hence a run's curve, are not those of vllm. Routed "
        "MoE experts keep vLLM's CPU kernel. Compiled engines (enforce_eager=false) of the two kernels keep "
        "separate entries in vLLM's compile cache."
    )
    reshard_bucket_mb: int = opt(
        DEFAULT_RESHARD_BUCKET_MB,
        "Bucket size of the Megatron -> vLLM weight reshard: bound on one bucket's send + receive bytes per rank, "
        "i.e. on the reshard's extra memory.", unit="MiB", min=1,
    )
    val_temperature: float = opt(0.0, "Sampling temperature during validation; 0 = greedy.", min=0)
    verify_sync: bool = opt(
        True, "After every reshard, check each received shard piece against its sender's checksum; a mismatch "
        "stops the run naming the parameter and ranks (cost: reshard/verify_time_s)."
    )
    env: Optional[str] = opt(
        None, "Multi-turn, tool-using rollouts (docs/multi_turn.md): an environment registered in megarl.envs (e.g. "
        "calculator) or 'path/to/file.py:factory' (factory(record, reward_fn) -> Environment); null = single-turn "
        "(one response per prompt). Needs data.chat_template hf or a Jinja template (the observations are rendered "
        "by it). 'agent:path/to/file.py:run' trains an agent written against the openai client (docs/serve.md, "
        "megarl.serving.agents): `async def run(record, base_url) -> float | (float, dict)`, each episode its own "
        "session base URL on the phase's OpenAI endpoint, its requests chained into token-exact trajectories."
    )
    agent_timeout_s: float = opt(
        600.0, "rollout.env=agent:...: wall-clock limit of one agent episode (its whole run(record, base_url)); past "
        "it the agent is cancelled, its episode gets reward 0 (its requests so far still train) and is counted in "
        "agent/timeouts; an agent that raises is counted in agent/errors the same way; the run goes on.",
        unit="s", min=0.001,
    )
    env_options: dict[str, Any] = opt(
        factory=dict, help="Multi-turn: keyword arguments of the environment's factory (e.g. system_prompt: null, "
        "max_output_chars: 200); reward_fn defaults to the job's reward.function."
    )
    max_turns: int = opt(4, "Multi-turn: model turns per episode.", unit="turns", min=1)
    max_tokens_per_turn: Optional[int] = opt(
        None, "Multi-turn: new tokens per model turn; null = max_new_tokens (which bounds the whole episode's "
        "generated tokens).", unit="tokens", min=1,
    )
    tool_parser: str = opt("hermes", "Multi-turn: how tool calls are read from a model turn (megarl.envs.tool_calls: "
                           "hermes = <tool_call>{json}</tool_call>, Qwen's and Hermes' format).")
    on_template_mismatch: Literal["error", "mask"] = opt(
        "error", "Multi-turn: when the tokens the chat template adds around the sampled turns (prompt, separators, "
        "observations, generation prompt) are not the ones held, e.g. a template that rewrites earlier turns: error "
        "= stop naming the episode and turn; mask = train that episode on nothing, counted in "
        "multi_turn/template_mismatch. Sampled ids are never re-encoded: a turn that is not the tokenizer's canonical "
        "encoding of its text, or holds an id beyond the tokenizer, is trained as sampled and only counted "
        "(multi_turn/noncanonical_turns, multi_turn/undecodable_turns)."
    )
    env_timeout_s: float = opt(
        600.0, "Multi-turn: bound on each call into the environment (reset, step with its tool calls, close). A "
        "reset or close that does not return stops the run naming the episode and call; a step that does not return "
        "is cancelled and ends its episode (trained on nothing), counted in multi_turn/step_timeouts and "
        "multi_turn/tool_timeouts, and the run goes on (a single tool call has its own, shorter deadline: the "
        "environment's tool_timeout_s, after which the model reads an error and the episode goes on).",
        unit="s", min=0.001,
    )
    max_concurrent_episodes: int = opt(
        256, "Multi-turn over a rollout client: episodes in flight at once, each its own coroutine that submits its "
        "next turn as soon as its observation is ready (megarl.envs.episode); the others wait for a slot. Also the "
        "bound on single-turn requests in flight, and on agents in flight (rollout.env=agent:...).",
        unit="episodes", min=1,
    )
    oversample: int = opt(
        0, "Single-turn: extra prompts drawn per step (and per dynamic-sampling round); the first "
        "data.prompts_per_step groups whose requests finish are trained on (in the order of their prompt index), the "
        "others' requests are aborted and counted in rollout/oversampled_aborted_groups (slime's over-sampling: the "
        "slowest groups no longer hold the step). The extra prompts are consumed from the loader. Which groups are "
        "kept depends on the engines' timing, so a run is no longer repeatable bit for bit; 0 = off.",
        unit="groups", min=0,
    )
    tool_threads: int = opt(
        16, "Multi-turn: threads of the pool that runs blocking (non-async) tools, shared by every episode of the "
        "process; async tools run on the event loop. A call waits for a free thread within its deadline; a call past "
        "its deadline is abandoned and holds its thread until it returns.", unit="threads", min=1,
    )
    max_concurrent_sandboxes: int = opt(
        8, "Multi-turn, rollout.env=python: sandbox runs (process trees) in flight at once; the others wait for a "
        "slot within their tool call's deadline.", unit="runs", min=1,
    )
    partial: Literal["finish", "continue"] = opt(
        "finish", "async: requests in flight at a weight push: finish = they complete on the old weights (the push "
        "waits for the batch in flight); continue = the push lands at once, mid-request (the engine servers pause "
        "with the requests kept, load the weights, resume): each request continues from the tokens it has (its KV "
        "recomputed under the new weights), every token recording the version that sampled it. Multi-turn episodes "
        "(rollout.env): a turn in the engine continues the same way; an episode in a tool call samples its next turn "
        "with the new weights."
    )


# --------------------------------------------------------------------------------------------------- algorithm


@dataclasses.dataclass(frozen=True, kw_only=True)
class KLConfig:
    """KL divergence between the actor and the reference policy."""

    coef: float = opt(0.0, "KL coefficient (initial value when adaptive); 0 disables the KL term.", min=0)
    kind: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = opt(
        "low_var_kl", "Per-token KL estimator (megarl.algorithms.kl; low_var_kl = k3)."
    )
    placement: Literal["reward", "loss"] = opt(
        "loss", "reward = subtract coef*KL from the token rewards; loss = add coef*KL to the policy loss."
    )
    target: Optional[float] = opt(
        None, "Adaptive KL controller target (per-sequence KL); null = fixed coef.", unit="nats", min=0
    )
    horizon: int = opt(10000, "Adaptive KL controller horizon.", unit="samples", min=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Rollout/train mismatch: metrics (always logged, under `mismatch/`) and its correction (off by default).

    The ratio is r = exp(logp_actor - logp_rollout) per response token, where logp_rollout is vLLM's log-prob of
    the sampled token and logp_actor the old-policy log-prob recomputed by Megatron before the update; the
    sequence ratio R is the product of a sequence's r. Off is right for the colocated synchronous trainer (same
    weights on both sides: only numerical differences); asynchronous / off-policy rollouts need tis or mask.
    See docs/rollout_correction.md.
    """

    tis: Literal["off", "token", "sequence"] = opt(
        "off", "Truncated importance sampling weight on the policy-gradient loss: token = min(r, c) per token; "
        "sequence = min(R, c) on every token of the sequence; off = no weight."
    )
    c: float = opt(
        2.0, "Ratio bound (> 1): the TIS truncation cap, and the band [1/c, c] of the mismatch/ratio_out_frac "
        "metrics.", unit="ratio"
    )
    mask: Literal["off", "token", "sequence"] = opt(
        "off", "Exclude from the loss the tokens (token) or whole sequences (sequence) whose r (or R) is outside "
        "[1/mask_c, mask_c]; counted in actor/rollout_masked_token_frac."
    )
    mask_c: Optional[float] = opt(
        None, "Band of the mask (> 1); null = c. Only with mask != off.", unit="ratio"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO's handling of responses cut at rollout.max_new_tokens (finish_reason 'length'); see
    megarl.algorithms.overlong. Both off by default."""

    filter: bool = opt(
        False, "Overlong filtering: truncated responses leave the policy (and value) loss; they still count in their "
        "group's advantages. overlong/filtered_samples counts them."
    )
    soft_cache_tokens: Optional[int] = opt(
        None, "L_cache of the soft overlong punishment: a response longer than rollout.max_new_tokens - L_cache gets "
        "a reward penalty growing linearly to -penalty_factor at max_new_tokens (overlong/penalty_mean); "
        "null = off.", unit="tokens", min=1,
    )
    penalty_factor: float = opt(1.0, "Scale of the soft overlong penalty (DAPO: 1).", min=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose scores are all equal (zero advantage under a group baseline) are
    dropped and more prompts are generated until the step holds data.prompts_per_step informative groups; see
    megarl.algorithms.dynamic_sampling. Off by default."""

    enabled: bool = opt(
        False, "Drop all-equal groups and sample more prompts to refill the step (group estimators: grpo, rloo, "
        "reinforce_plus_plus_baseline; rule rewards only). Metrics: dynamic_sampling/rounds, dropped_groups, "
        "filled_groups, surplus_groups."
    )
    max_rounds: int = opt(
        3, "Most generation rounds per step, the first included (each round: data.prompts_per_step prompts). When "
        "they run out, all-equal groups fill the batch (dynamic_sampling/filled_groups).", unit="rounds", min=1,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL objective."""

    name: Literal["grpo", "ppo", "rloo", "reinforce_plus_plus", "dr_grpo", "gspo", "cispo"] = opt(
        "grpo", "Algorithm preset: fills every field below marked 'null = the preset's' (PRESETS in "
        "megarl.config.schema). dr_grpo = GRPO without std normalisation, token sums / loss_norm_horizon; gspo = "
        "sequence-level ratio; cispo = clipped stop-gradient IS weight x log-prob. Explicit fields win."
    )
    advantage_estimator: Optional[
        Literal["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
    ] = opt(
        None, "Advantage estimator; null = the preset's (ppo: gae, rloo: rloo, reinforce_plus_plus: "
        "reinforce_plus_plus, the others: grpo)."
    )
    policy_loss: Optional[Literal["ppo", "gspo", "cispo"]] = opt(
        None, "Policy loss: ppo = token-level clipped ratio; gspo = sequence-level ratio (use ~3e-4 clips); cispo = "
        "clip(ratio) as a stop-gradient weight on every token's log-prob. null = the preset's (gspo, cispo: "
        "themselves; else ppo)."
    )
    grpo_norm_by_std: Optional[bool] = opt(
        None, "GRPO: divide group-centred rewards by the group std; null = the preset's (false for dr_grpo)."
    )
    gamma: float = opt(1.0, "Discount factor (GAE, REINFORCE++).", min=0)
    lam: float = opt(1.0, "GAE lambda.", min=0)
    clip_low: Optional[float] = opt(
        None, "Ratio clip below 1: ratio >= 1 - clip_low (CISPO: the weight's floor; 1 = none). null = the "
        "preset's (0.2; gspo 3e-4; cispo 1.0).", min=0
    )
    clip_high: Optional[float] = opt(
        None, "Ratio clip above 1: ratio <= 1 + clip_high (> clip_low = DAPO's clip-higher). null = the preset's "
        "(0.2; gspo 4e-4; cispo 5.0).", min=0
    )
    clip_c: Optional[float] = opt(
        None, "Dual-clip constant (> 1) bounding the loss of negative advantages; null = off."
    )
    loss_agg: Optional[
        Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    ] = opt(
        None, "How per-token losses are reduced to the mini-batch loss; null = the preset's (token-mean; dr_grpo "
        "seq-mean-token-sum-norm; gspo seq-mean-token-mean)."
    )
    loss_norm_horizon: Optional[int] = opt(
        None, "Divisor of seq-mean-token-sum-norm; null = rollout.max_new_tokens.", unit="tokens", min=1
    )
    entropy_coef: float = opt(0.0, "Entropy bonus coefficient.", min=0)
    ppo_epochs: int = opt(1, "Passes over each step's samples.", unit="epochs", min=1)
    old_log_probs: Literal["auto", "recompute"] = opt(
        "auto", "Where the PPO ratio's old-policy log-probs come from. auto: from the actor update's own forward "
        "(detached) when the step is one optimizer step (one mini-batch, ppo_epochs 1) with no rollout correction, "
        "no KL in the reward and no router replay, saving a forward pass; otherwise a separate forward before the "
        "update. recompute: always the separate forward. The metric actor/old_log_probs_fused says which ran."
    )
    router_replay: Literal["none", "old", "rollout"] = opt(
        "none", "MoE routing replay in the actor update. none: each forward routes by itself. old: the update's "
        "forward uses the experts the old-log-prob forward chose for every token and MoE layer (recorded there; "
        "old_log_probs: auto then always runs that separate forward); metric actor/moe_routing_diff_frac = tokens "
        "whose own routing would differ. rollout: the experts vLLM chose during generation (captured on vLLM's "
        "workers; prefix caching is turned off for it) are replayed in the old-log-prob forward for every token "
        "vLLM routed (the last sampled token and padding route by themselves), and the experts that forward used "
        "are replayed in the update; metric "
        "actor/moe_rollout_routing_diff_frac = (token, MoE layer) choices where the actor's own top-k set differs "
        "from vLLM's.",
    )
    kl: KLConfig = opt(factory=KLConfig, help="KL penalty against the reference policy.")
    overlong: OverlongConfig = opt(factory=OverlongConfig, help="DAPO: truncated responses (filtering, soft penalty).")
    dynamic_sampling: DynamicSamplingConfig = opt(
        factory=DynamicSamplingConfig, help="DAPO: drop all-equal groups and sample more prompts."
    )
    rollout_correction: RolloutCorrectionConfig = opt(
        factory=RolloutCorrectionConfig, help="Rollout/train log-prob mismatch: importance weights and masks."
    )

    def setting(self, key: str) -> Any:
        """The value in effect of a preset field (`PRESET_FIELDS`): explicit, else `algorithm.name`'s preset's."""
        if key not in PRESET_FIELDS:
            raise KeyError(f"{key!r} is not set by algorithm presets; preset fields: {PRESET_FIELDS}")
        value = getattr(self, key)
        return getattr(PRESETS[self.name], key) if value is None else value

    @property
    def estimator(self) -> str:
        """The advantage estimator in effect (explicit, else the preset's)."""
        return self.setting("advantage_estimator")


@dataclasses.dataclass(frozen=True)
class AlgorithmPreset:
    """What `algorithm.name` puts in each of these `AlgorithmConfig` fields when the config leaves it null."""

    advantage_estimator: str
    policy_loss: str = "ppo"
    grpo_norm_by_std: bool = True
    loss_agg: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2


PRESETS = {
    "grpo": AlgorithmPreset("grpo"),
    "ppo": AlgorithmPreset("gae"),
    "rloo": AlgorithmPreset("rloo"),
    "reinforce_plus_plus": AlgorithmPreset("reinforce_plus_plus"),
    # Liu et al. 2025 ("Understanding R1-Zero-like training"): no std division, token sums over a constant length
    "dr_grpo": AlgorithmPreset("grpo", grpo_norm_by_std=False, loss_agg="seq-mean-token-sum-norm"),
    # Zheng et al. 2025: sequence-level ratio, the paper's clip ranges
    "gspo": AlgorithmPreset("grpo", policy_loss="gspo", loss_agg="seq-mean-token-mean", clip_low=3e-4, clip_high=4e-4),
    # MiniMax-M1 (Chen et al. 2025): no lower bound on the weight, upper bound tuned (5.0: SkyRL's example)
    "cispo": AlgorithmPreset("grpo", policy_loss="cispo", clip_low=1.0, clip_high=5.0),
}
PRESET_FIELDS = tuple(f.name for f in dataclasses.fields(AlgorithmPreset))
DEFAULT_ESTIMATOR = {name: p.advantage_estimator for name, p in PRESETS.items()}


# --------------------------------------------------------------------------------------------------- data, reward


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The prompt dataset."""

    train_path: str = opt(help="Training prompts (.jsonl or .parquet).")
    val_path: Optional[str] = opt(None, "Validation prompts; null = no validation.")
    prompt_key: str = opt("prompt", "Column holding the prompt (a string, or a list of chat messages).")
    answer_key: str = opt("answer", "Column holding the reference answer passed to the reward function.")
    chat_template: Optional[str] = opt(
        None, "Chat template: null = the tokenizer's, 'none' = raw prompt text, else a Jinja template string."
    )
    prompts_per_step: int = opt(help="Prompts per RL step, global.", unit="prompts, global", min=1)
    shuffle: bool = opt(True, "Shuffle the training prompts every epoch.")
    seed: int = opt(0, "Seed of the shuffle.")


DEFAULT_JUDGE_TEMPLATE = (
    "Question: {question}\nResponse: {response}\nReference answer: {reference}\n"
    "Is the response correct? Answer Yes or No."
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """A generative reward model (an LLM judge) served on vLLM engines of its own, never weight-synced
    (`megarl.rollout.judge`, docs/judge.md). Each response is shown to the judge through `template`, rendered by the
    judge tokenizer's chat template as one user message with the generation prompt; the judge's answer is read by
    `parse`. Groups are judged as their requests finish, while the step's other requests still generate. Metrics:
    judge/requests, judge/cache_hits, judge/parse_failures, judge/errors (each a count over the step),
    judge/latency_s (mean seconds of a judged response's requests), judge/score_mean."""

    model: str = opt(help="HF directory of the judge model (weights, config and a tokenizer with a chat template).")
    pool: str = opt(help="Resource pool the judge engines run on (a key of resources.pools): a pool of their own, "
                    "hosting no role and not rollout.pool (no colocation: docs/judge.md says why); its devices / tp "
                    "engines serve the judge.")
    tp: int = opt(1, "Tensor-parallel size of each judge engine; must divide the judge pool's devices.", min=1)
    template: str = opt(
        DEFAULT_JUDGE_TEMPLATE, "The judge's user message: a Python format string with the placeholders {question} "
        "(the prompt's text, data.prompt_key), {response} (the decoded response; multi-turn: the episode's final "
        "model turn; required), {reference} (data.answer_key) and {transcript} (multi-turn: everything after the "
        "prompt, every model turn and observation, decoded; single-turn: the response); literal braces doubled. Or "
        "'@path/to/file.txt': the template read from that file.",
    )
    parse: Literal["number", "verdict", "yes_no_logprob"] = opt(
        "yes_no_logprob", "How the judge's answer becomes a score: number = the first number in its answer, which "
        "must lie in score_range (else a parse failure); verdict = the first word of its answer that is a key of "
        "verdicts (case-insensitive), scored by it; yes_no_logprob = P(yes)/(P(yes)+P(no)) of the judge's next "
        "token after the prompt (no sampling: the raw log-probs of the first token of each of yes_no's words, read "
        "from vLLM prompt log-probs of the prompt followed by that token, one request each).",
    )
    verdicts: dict[str, float] = opt(
        factory=dict, help="parse: verdict: verdict word -> score, e.g. {correct: 1.0, incorrect: 0.0}.")
    yes_no: tuple[str, str] = opt(
        ("Yes", "No"), "parse: yes_no_logprob: the (yes, no) answer words; their first tokens must differ.")
    score_range: tuple[float, float] = opt(
        (0.0, 10.0), "parse: number: the (low, high) range a judged number must lie in (inclusive).")
    normalize: bool = opt(
        True, "parse: number: map score_range linearly onto [0, 1] (low -> 0, high -> 1); false = the raw number.")
    max_new_tokens: int = opt(16, "Longest judge answer (number / verdict; yes_no_logprob samples nothing).",
                              unit="tokens", min=1)
    max_prompt_tokens: int = opt(
        1024, "Longest rendered judge prompt; a longer one is not sent and scores fallback_score (judge/errors).",
        unit="tokens", min=1,
    )
    max_concurrent: int = opt(64, "Judge requests in flight at once, over the whole run (the others wait for a "
                              "slot).", unit="requests", min=1)
    timeout_s: float = opt(120.0, "Bound on one judge request; a late one scores fallback_score (judge/errors).",
                           unit="s", min=0.001)
    cache: bool = opt(True, "Keep each (prompt, response)'s score for the run: a repeated pair is not judged again "
                      "(judge/cache_hits).")
    cache_entries: int = opt(100_000, "Most scores the cache keeps; beyond it the least recently used is forgotten.",
                             unit="responses", min=1)
    fallback_score: float = opt(
        0.0, "Score of a response the judge did not answer (error, timeout, overlong prompt: judge/errors) or "
        "answered unparseably (judge/parse_failures); the run goes on.",
    )
    weight: float = opt(1.0, "The judge's score's weight in the reward: reward = weight x judge score + "
                        "function_weight x rule score.")
    function_weight: float = opt(
        0.0, "Weight of the rule reward beside the judge: reward.function's score of the response (single-turn; "
        "on_error, timeout_s and max_error_fraction apply) or the episode's summed environment rewards "
        "(multi-turn). 0 = the judge replaces it (single-turn: reward.function is not called).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The reward function applied to each response (rule-based or user code)."""

    function: str = opt("exact_match", "Name of a registered reward function (megarl.rewards).")
    file: Optional[str] = opt(None, "Python file defining `function` (user reward); null = built-in registry.")
    on_error: Literal["raise", "zero"] = opt(
        "raise", "A reward call that raises, returns a non-finite value or times out: raise = stop the run naming "
        "the response and its dataset record; zero = score it 0, count it (reward/errors, reward/timeouts, "
        "reward/error_frac) and go on, within max_error_fraction."
    )
    max_error_fraction: float = opt(
        0.1, "With on_error=zero: the run stops when more than this fraction of a step's responses fail.",
        unit="fraction", min=0,
    )
    timeout_s: Optional[float] = opt(
        None, "Deadline of one reward call; a late call is abandoned (it finishes in a background thread, its "
        "result dropped) and counts as a failure. null = no deadline.", unit="seconds", min=0,
    )
    judge: Optional[JudgeConfig] = opt(
        None, "An LLM judge scores every response (multi-turn: each episode's final turn), instead of `function` or "
        "beside it by weights (judge.weight, judge.function_weight); null = no judge.")


# --------------------------------------------------------------------------------------------------- trainer


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Metric sinks, console output and plots."""

    backends: tuple[Literal["console", "jsonl", "tensorboard", "wandb"], ...] = opt(
        ("console",), "Where metrics go besides <dir>/metrics.jsonl (always written): console lines or progress bar, "
        "a TensorBoard event file in <dir>/tensorboard (extra `logging`), a W&B run in <dir>/wandb (extra `wandb`; "
        "offline with WANDB_MODE=offline). jsonl is accepted for older configs."
    )
    dir: str = opt("runs/megarl", "Run directory: metrics.jsonl, plots/, tensorboard/, wandb/.")
    project: str = opt("megarl", "Project name (wandb).")
    run_name: Optional[str] = opt(None, "Run name; null = generated from the time.")
    vendor_level: Literal["debug", "info", "warning", "error"] = opt(
        "error", "How much of vLLM's, Ray's, megatron-core's, torch's and transformers' own logs and warnings get "
        "through, in the controller and the workers (megarl/platform/vendor_logs.py); `megarl train --verbose` = info."
    )
    progress: Literal["auto", "bar", "lines"] = opt(
        "auto", "Console progress: a bar over steps (reward, KL, step time, ETA), or one line per logged step; auto = "
        "the bar on a terminal, lines otherwise."
    )
    plots: bool = opt(True, "Write PNG plots of the run (<dir>/plots, needs matplotlib: extra `plots`) and print a "
                            "summary table at the end.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Megatron distributed checkpoints."""

    dir: Optional[str] = opt(None, "Checkpoint directory; null = no checkpoints.")
    save_every: int = opt(0, "Save every this many RL steps; 0 = only at the end.", unit="steps", min=0)
    keep_last: int = opt(2, "Checkpoints kept; older ones are deleted. 0 keeps all.", min=0)
    resume: bool = opt(True, "Resume from the newest checkpoint in dir when there is one.")
    allow_config_change: bool = opt(
        False,
        "Resume even when the config differs from the checkpoint's in a way that breaks an exact resume (the changed "
        "keys are named either way; log/checkpoint/layout changes never need this).",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The RL loop."""

    total_steps: int = opt(help="RL steps to run.", unit="steps", min=1)
    seed: int = opt(1234, "Seed of model init and Megatron RNG.")
    val_every: int = opt(0, "Validate every this many steps; 0 = never.", unit="steps", min=0)
    log_every: int = opt(1, "Log metrics every this many steps.", unit="steps", min=1)
    max_skipped_steps: int = opt(
        3, "Stop the run after this many optimizer steps in a row were skipped for a non-finite loss or gradient "
        "norm (actor or critic; each skip is counted in <role>/skipped_steps).", unit="optimizer steps", min=1,
    )
    mode: Literal["sync", "one_step_off", "async"] = opt(
        "sync", "Schedule of rollout against training (docs/async.md): sync = generate, then train on it (on-policy); "
        "one_step_off = step k+1's rollout runs with the weights before update k while step k trains (one version "
        "stale, deterministic); async = rollout runs continuously into a bounded buffer (needs rollout.pool), the "
        "trainer takes batches at most max_staleness versions old. Off-policy modes need "
        "algorithm.rollout_correction (tis or mask)."
    )
    max_staleness: int = opt(
        1, "async: the most policy versions a trained token may lag the weights being updated (per sample: its "
        "oldest token). Older batches follow stale_policy.", unit="versions", min=0,
    )
    stale_policy: Literal["wait", "drop"] = opt(
        "wait", "async: wait = rollout does not start a batch that would be too stale when trained (never wasted "
        "work); drop = rollout runs free and batches beyond max_staleness are dropped, counted (async/dropped_batches)."
    )
    sync_every: int = opt(
        1, "async: push the actor's weights into the engines every this many updates (<= max_staleness + 1).",
        unit="updates", min=1,
    )


# --------------------------------------------------------------------------------------------------- distillation


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherConfig(RoleConfig):
    """A frozen teacher of on-policy distillation: a Megatron forward-only role (as the reference is) that computes
    the log-probs of the student's sampled tokens, loaded from its own checkpoint."""

    path: str = opt(
        help="The teacher's checkpoint: an HF directory (config.json + safetensors), or a megarl/Megatron "
        "distributed checkpoint of a trained role (a checkpoint's step_NNNNNN/actor directory, which holds the HF "
        "config.json and tokenizer files beside the weights). Its tokenizer must be the student's "
        "(checked at start-up)."
    )
    pool: Optional[str] = opt(
        None, "Resource pool the teacher runs on; null = the actor's (colocated, offloaded per `offload` while idle); "
        "another pool = the teachers' own (no rollout engines, judge or other role on it; every teacher on the "
        "same pool and layout)."
    )
    data_source: Optional[str] = opt(
        None, "With several teachers: the value of the dataset column distillation.data_source_key whose samples "
        "this teacher scores; null = the samples no other teacher claims (at most one teacher may leave it null)."
    )
    backend: Literal["megatron", "vllm"] = opt(
        "megatron", "How the teacher computes its log-probs: megatron = a forward-only Megatron role at `parallel` "
        "(colocated or on its pool); vllm = vLLM engines on a pool of the teacher's own (`pool` required, an HF "
        "`path`), one per parallel.tp devices, never weight-synced, the sampled tokens' log-probs read as vLLM prompt "
        "log-probs (docs/distillation.md: which is faster where)."
    )
    max_concurrent: int = opt(
        64, "backend vllm: prompt log-probs requests (one per row of a step's batch) in flight at most.", min=1,
    )
    request_timeout_s: float = opt(
        600.0, "backend vllm: bound of one prompt log-probs request; past it the step fails naming the teacher.",
        unit="s", min=0,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillationConfig:
    """On-policy distillation: the student (the actor) samples, teachers score every sampled token; the per-token
    reverse KL to the teacher is the advantage (docs/distillation.md)."""

    teachers: dict[str, TeacherConfig] = opt(
        factory=dict, help="The teachers by name (the name appears in the metrics: distill/reverse_kl/<name>); "
        "empty = no distillation."
    )
    coef: float = opt(
        1.0, "Weight of the per-token reverse-KL advantage: advantage[t] = coef * (teacher log-prob - student "
        "old log-prob) of each sampled token t, plus task_reward_coef * the estimator's advantage.", min=0,
    )
    task_reward_coef: float = opt(
        0.0, "Weight of the task reward's advantage (algorithm.advantage_estimator on reward.function's scores) "
        "added to the distillation advantage; 0 = pure distillation.", min=0,
    )
    top_k: int = opt(
        0, "Tokens of the teacher's top-k distribution for the top-k forward KL loss term: at each sampled token, "
        "sum over the teacher's k most likely tokens of p_teacher * (log p_teacher - log p_student), not "
        "renormalised, added to the actor's loss with weight top_k_coef (docs/distillation.md); 0 = off (only the "
        "reverse-KL advantage).", unit="tokens", min=0,
    )
    top_k_coef: float = opt(
        1.0, "Weight of the top-k forward KL term in the actor's loss (aggregated as the policy loss, "
        "algorithm.loss_agg); read only with top_k > 0.", min=0,
    )
    data_source_key: str = opt(
        "data_source", "Dataset column naming each prompt's data source (routes samples to teachers by their "
        "data_source; read only with several teachers)."
    )

    @property
    def enabled(self) -> bool:
        return any(t.enabled for t in self.teachers.values())


# --------------------------------------------------------------------------------------------------- job


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole megarl job."""

    model: ModelConfig = opt(help="The policy model (actor, reference, rollout; critic unless overridden).")
    resources: ResourcesConfig = opt(factory=ResourcesConfig, help="Device pools.")
    actor: ActorConfig = opt(factory=ActorConfig, help="The policy being trained.")
    critic: CriticConfig = opt(factory=CriticConfig, help="The value model (PPO).")
    reference: ReferenceConfig = opt(factory=ReferenceConfig, help="The frozen reference policy (KL).")
    reward_model: RewardModelConfig = opt(factory=RewardModelConfig, help="A learned reward model.")
    rollout: RolloutConfig = opt(factory=RolloutConfig, help="Generation settings.")
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig, help="Advantages, losses and KL.")
    reward: RewardConfig = opt(factory=RewardConfig, help="Rule-based / user reward function.")
    data: DataConfig = opt(help="Prompt dataset and the global batch size.")
    trainer: TrainerConfig = opt(help="Length and cadence of the RL loop.")
    logging: LoggingConfig = opt(factory=LoggingConfig, help="Metric sinks.")
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig, help="Checkpointing and resume.")
    distillation: DistillationConfig = opt(
        factory=DistillationConfig, help="On-policy distillation from teacher models."
    )

    ROLES = ("actor", "critic", "reference", "reward_model")

    def role(self, name: str) -> RoleConfig:
        if name not in self.ROLES:
            raise KeyError(name)
        return getattr(self, name)

    def enabled_roles(self) -> list[str]:
        return [r for r in self.ROLES if self.role(r).enabled]
