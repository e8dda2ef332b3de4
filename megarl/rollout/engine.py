"""The rollout engine protocol, sampling settings, rollout samples and the prompt-length policy.

Nothing here imports vLLM: trainers and tests program against `RolloutEngine`; `megarl.rollout.vllm_adapter` is the
only implementation and the only module that touches vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Literal, Optional, Protocol, Sequence

import torch

from megarl.data.token_rows import attach_ref, token_ref

logger = logging.getLogger("megarl.rollout")

FinishReason = Literal["stop", "length"]
OverlongPolicy = Literal["drop", "truncate", "error"]
WeightLayout = Literal["hf", "vllm_shard"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    """How to sample responses. Field names follow the `rollout` config (`megarl.config.schema.RolloutConfig`).

    `seed` is the base of per-request seeds: request (prompt i of a call) gets seed `seed * 1_000_003 + i`, so a
    call is reproducible whatever the batch composition, and distinct prompts never share a random stream. Change
    `seed` between RL steps (e.g. `dataclasses.replace(s, seed=base + step)`) to draw fresh samples. None = unseeded.
    """

    samples_per_prompt: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    max_new_tokens: int = 512  # tokens
    stop: tuple[str, ...] = ()  # extra stop strings; EOS always stops unless ignore_eos
    stop_token_ids: tuple[int, ...] = ()  # extra stop token ids
    seed: Optional[int] = 0
    ignore_eos: bool = False  # benchmarks / tests that need fixed-length responses
    # Longest prompt of this call (tokens); None = the engine's rollout.max_prompt_tokens. A partial rollout's
    # continuation (`megarl.trainer.schedule`) passes prompt + the tokens sampled so far as its prompt, and raises
    # the limit by those tokens (prompt + max_new_tokens still fits the engine's max_model_len).
    max_prompt_tokens: Optional[int] = None
    # Also return the log-prob of every prompt token given the tokens before it (`GenerationOutput.prompt_log_probs`;
    # vLLM `prompt_logprobs=0`, raw model log-probs): what a judge reads the log-prob of a candidate answer token
    # from (`megarl.rollout.judge`). Request API only.
    prompt_log_probs: bool = False

    def __post_init__(self) -> None:
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be >= 1, got {self.samples_per_prompt}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_config(cls, rollout: Any, *, validation: bool = False, **overrides: Any) -> "SamplingSettings":
        """From a `RolloutConfig`; `validation=True` uses `val_temperature` and one sample per prompt."""
        kw = dict(
            samples_per_prompt=1 if validation else rollout.samples_per_prompt,
            temperature=rollout.val_temperature if validation else rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_new_tokens=rollout.max_new_tokens,
            stop=tuple(rollout.stop),
            seed=rollout.seed,
            ignore_eos=bool(getattr(rollout, "ignore_eos", False)) and not validation,
        )
        kw.update(overrides)
        return cls(**kw)

    def request_seed(self, prompt_index: int) -> Optional[int]:
        """The vLLM per-request seed of prompt `prompt_index` of a call (see the class docstring)."""
        if self.seed is None:
            return None
        return (self.seed * 1_000_003 + prompt_index) % (2**63 - 1)


@dataclasses.dataclass(frozen=True)
class RolloutSample:
    """One sampled response.

    prompt_index: index of its prompt in the list given to `generate` (dropped prompts produce no samples).
    sample_index: 0..samples_per_prompt-1 within that prompt (the GRPO group member).
    prompt_ids: the prompt actually used (after truncation, if any).
    response_ids: generated token ids, EOS/stop token included when generation stopped on it.
    response_log_probs: [len(response_ids)] float, log p_model(token) of each sampled token under the raw model
        distribution (log-softmax of the logits before temperature/top-k/top-p; vLLM logprobs_mode="raw_logprobs").
    finish_reason: 'stop' (EOS, stop string or stop id) or 'length' (max_new_tokens reached).
    routed_experts: only when the engine captures routing (`algorithm.router_replay: rollout`): [P, L, k] int16
        numpy, the k experts each of the model's L MoE layers (layer order) chose for the tokens at positions
        0..P-1 of prompt + response, P = len(prompt_ids) + len(response_ids) - 1 (the last sampled token is never
        fed back through the model, so it has no routing).
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_log_probs: list[float]
    finish_reason: FinishReason
    routed_experts: Optional[Any] = None


class RolloutSamples(list):
    """`list[RolloutSample]` ordered by (prompt_index, sample_index), plus what the prompt policy did.

    dropped_prompt_indices: prompts longer than `rollout.max_prompt_tokens` that produced no samples
        (`overlong_prompt: drop`). truncated_prompt_indices: prompts cut to their last max_prompt_tokens tokens.
    """

    def __init__(self, samples: Iterable[RolloutSample] = (), *, dropped_prompt_indices: Sequence[int] = (),
                 truncated_prompt_indices: Sequence[int] = ()) -> None:
        super().__init__(samples)
        self.dropped_prompt_indices = list(dropped_prompt_indices)
        self.truncated_prompt_indices = list(truncated_prompt_indices)
        self.generate_s: Optional[float] = None  # seconds the engines spent on the call, when a service measured it


class OverlongPromptError(ValueError):
    """A prompt exceeds `rollout.max_prompt_tokens` and `rollout.overlong_prompt` is 'error'."""


@dataclasses.dataclass(frozen=True)
class PromptPlan:
    """The result of the prompt-length policy: which prompts go to the engine, in the caller's order."""

    kept_indices: list[int]  # positions in the caller's list
    prompts: list[list[int]]  # the kept prompts (truncated where needed), aligned with kept_indices
    dropped_indices: list[int]
    truncated_indices: list[int]


def plan_prompts(prompts: Sequence[Sequence[int]], max_prompt_tokens: int, policy: OverlongPolicy) -> PromptPlan:
    """Apply `rollout.overlong_prompt` to prompts longer than `max_prompt_tokens` (pure; logs what it did).

    drop: remove them (their indices are returned); truncate: keep the LAST max_prompt_tokens tokens (the end of a
    chat-templated prompt carries the generation prompt); error: raise `OverlongPromptError`. Empty prompts are
    always an error (vLLM cannot generate from nothing). Never silent: one warning line with the count and the key.
    """
    if policy not in ("drop", "truncate", "error"):
        raise ValueError(f"rollout.overlong_prompt must be drop|truncate|error, got {policy!r}")
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"{len(empty)} empty prompt(s) at indices {empty[:10]}: every prompt needs >= 1 token")
    over = [i for i, p in enumerate(prompts) if len(p) > max_prompt_tokens]
    if over:
        longest = max(len(prompts[i]) for i in over)
        msg = (f"{len(over)} of {len(prompts)} prompts are longer than rollout.max_prompt_tokens={max_prompt_tokens} "
               f"(longest {longest} tokens)")
        if policy == "error":
            raise OverlongPromptError(f"{msg}; raise rollout.max_prompt_tokens or set rollout.overlong_prompt to "
                                      f"drop or truncate (indices {over[:10]})")
        action = "dropped" if policy == "drop" else "truncated to their last tokens"
        logger.warning("%s: %s (rollout.overlong_prompt=%s); raise rollout.max_prompt_tokens to keep them",
                       msg, action, policy)
    over_set = set(over)
    kept, kept_prompts = [], []
    for i, p in enumerate(prompts):
        if i in over_set and policy == "drop":
            continue
        kept.append(i)
        kept_prompts.append(list(p[-max_prompt_tokens:]) if i in over_set else list(p))
    return PromptPlan(
        kept_indices=kept,
        prompts=kept_prompts,
        dropped_indices=over if policy == "drop" else [],
        truncated_indices=over if policy == "truncate" else [],
    )


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request of the request-level API (`RolloutEngine.submit`), beside the batch `generate`.

    request_id: the caller's id, unique among the engine's requests in flight (outputs and `abort` name it).
    prompt_ids: the prompt's token ids (>= 1 token); `rollout.overlong_prompt` applies as in `generate`.
    sampling: its own settings (temperature, top-p/k, max_new_tokens, stops, samples_per_prompt completions).
    seed_index: the request's vLLM seed is `sampling.request_seed(seed_index)`, the seed that prompt `seed_index`
        of a batch `generate(prompts, sampling)` call gets: a request reproduces that prompt's samples.
    stream: also return partial outputs (the tokens so far) from `step`/`poll` while it runs.
    keep_output: False where nothing trains on its output (validation, the Python API's `generate`): the rollout
        host puts no by-reference package of it into the object store (`megarl.data.token_rows`).
    """

    request_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingSettings
    seed_index: int = 0
    stream: bool = False
    keep_output: bool = True


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled completion of a request (sample `sample_index` of its samples_per_prompt).

    token_ids: generated ids so far (EOS/stop token included when it stopped on one); log_probs: [len(token_ids)]
    raw model log-probs of those tokens (as `RolloutSample.response_log_probs`); finish_reason: 'stop' or
    'length' once finished, None while it runs (a streamed partial output); versions: [len(token_ids)] the weights
    version that sampled each token, where the caller knows it (the request-level server sets it; None otherwise).
    """

    sample_index: int
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: Optional[FinishReason]
    versions: Optional[list[int]] = None


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """What `step`/`poll` return for a request: its completions (ordered by sample_index; a partial output of a
    streamed request holds those that have produced tokens) and whether it has finished (then every completion
    has a finish reason and the request has left the engine)."""

    request_id: str
    prompt_ids: list[int]  # the prompt used (truncated by the prompt policy where it applied)
    completions: list[Completion]
    finished: bool
    # [len(prompt_ids) - 1] float: log p(prompt_ids[j + 1] | prompt_ids[:j + 1]), raw model log-probs, on a finished
    # output of a request with `sampling.prompt_log_probs`; None otherwise
    prompt_log_probs: Optional[list[float]] = None

    def samples(self, prompt_index: int = 0) -> list[RolloutSample]:
        """The completions as `RolloutSample`s of prompt `prompt_index` (a finished output only)."""
        if not self.finished:
            raise ValueError(f"request {self.request_id!r} has not finished: no samples yet")
        # a completion's package on the rollout rank that made it (`megarl.data.token_rows`) follows it
        return [attach_ref(RolloutSample(prompt_index, c.sample_index, list(self.prompt_ids), list(c.token_ids),
                                         list(c.log_probs), c.finish_reason), token_ref(c)) for c in self.completions]


class RolloutEngine(Protocol):
    """What megarl needs from an inference engine: the batch `generate` of the synchronous step, the request-level
    API (`submit` / `step` / `poll` / `abort` / `pause` / `resume`), memory phases and weight loading.

    Every method is called on every rank of the engine's world (SPMD). `generate` takes this rank's inference-DP
    share of the prompts; ranks of one tensor-parallel replica must be given the same prompts (the vLLM engine
    checks a digest of them over the replica and refuses a mismatch). The request API has the same rule, stronger:
    every TP rank of a replica makes the same calls (submit, abort, pause, resume, and as many steps) with the same
    arguments in the same order; each call but `step` checks a digest of (call, ordinal, steps so far, arguments).
    """

    tp_rank: int  # this rank's position in its TP replica (0: the rank that reports results)
    replica_index: int  # this rank's replica: rank // tp
    replicas: int  # independent replicas in the engine's world: world // tp
    events: Any  # (call, argument) of every memory-phase / weight / generate call, in order (a bounded deque)

    @property
    def sleep_discards_weights(self) -> bool:
        """Whether `sleep(level=2)` drops the weights (so a rollout after it needs fresh weights first)."""
        ...

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutSamples:
        """Sample `sampling.samples_per_prompt` responses per prompt after the prompt-length policy."""
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], layout: WeightLayout = "hf",
                       version: Optional[int] = None) -> int:
        """Load new weights (see the implementation for the layouts); resets the prefix cache; returns #tensors.
        `version`: the new `weight_version` (None: unchanged). With requests of the request API in flight only while
        paused: they stay in flight and continue from their tokens under the new weights after `resume`."""
        ...

    def load_lora(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], verify: bool = True,
                  version: Optional[int] = None) -> list[str]:
        """Load a LoRA adapter (PEFT names and layout, full tensors; `config`: PEFT's adapter_config) in memory,
        replacing the previous one, for every later generation; `verify` reads back what the engine holds. Resets the
        prefix cache. Engines built without LoRA support refuse it."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights loaded now (0 at start): each sampled token's `Completion.versions` entry."""
        ...

    def set_weight_version(self, version: int) -> None:
        """Label the loaded weights `version` (for pushes that write weights without `update_weights`)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free memory for training (GPU: KV cache, and weights at level 2). CPU: no-op."""
        ...

    def wake(self, tags: Optional[tuple[str, ...]] = None) -> None:
        """Undo `sleep` (tags None: all; ("weights",) or ("kv_cache",): that part only). CPU: no-op."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forget cached KV blocks (they were computed with the old weights)."""
        ...

    def param_shards(self) -> list:
        """This rank's parameters (`megarl.rollout.vllm_layout.ParamShard`): names and shard shapes, what a sink
        feeds `update_weights(layout="vllm_shard")` with."""
        ...

    def writable_params(self) -> dict[str, torch.Tensor]:
        """Live parameters that may be written in place, by name ({} where none can: every shard goes through
        `update_weights`)."""
        ...

    def shm_segments(self) -> list[str]:
        """Names in /dev/shm of the shared-memory segments this process's engine created (removed by the controller
        after the workers are gone)."""
        ...

    # -- the request-level API --------------------------------------------------------------------------------
    def submit(self, requests: Sequence[GenerationRequest]) -> list[str]:
        """Queue `requests` (ids unique among those in flight); returns the ids dropped by the prompt policy
        (`overlong_prompt: drop`), which produce no output. Nothing runs until `step`/`poll`."""
        ...

    def step(self) -> list[GenerationOutput]:
        """One engine iteration over the requests in flight (none while paused): the outputs of the requests that
        finished in it and partial outputs of streamed requests that produced tokens."""
        ...

    def poll(self, min_finished: int = 1) -> list[GenerationOutput]:
        """`step` until `min_finished` requests have finished, or none is left in flight, or the engine is paused;
        everything those steps returned, in order."""
        ...

    def abort(self, request_ids: Sequence[str]) -> int:
        """Remove requests in flight (no output will come for them); returns how many were in flight."""
        ...

    def pause(self) -> None:
        """Hold every request in flight with its progress: `step` runs nothing until `resume`; `submit` still queues
        and weights may be updated."""
        ...

    def resume(self) -> None:
        """Undo `pause`; after a weight update the held requests recompute their KV (prompt + tokens so far) under
        the new weights and continue."""
        ...
