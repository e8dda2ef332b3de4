"""The request-level API of the vLLM rollout engine: `submit` / `step` / `poll` / `abort` / `pause` / `resume`,
beside the batch `generate` (`megarl.rollout.vllm_adapter`; with it and `vllm_weights` the only modules touching vLLM).

Built on the `LLMEngine` under the in-process `vllm.LLM` (vllm 0.32 `v1/engine/llm_engine.py`): a request is rendered
from its token ids the way `LLM.generate` renders a prompt (`LLM._preprocess_cmpl_one`), added with
`LLMEngine.add_request(request_id, ...)` under the caller's id (vLLM suffixes it internally and reports outputs under
the caller's), advanced by `LLMEngine.step()` and removed by `LLMEngine.abort_request(ids)` (the caller's ids: vLLM
maps them to its internal ones, children of n > 1 included). Sampling parameters are the batch path's
(`sampling_params`), seeded `sampling.request_seed(seed_index)`: a request reproduces prompt `seed_index` of a batch
`generate` call with the same settings. A request without `stream` is added FINAL_ONLY (one output when all its
samples finished, what `LLM.generate` does); a streamed one CUMULATIVE (each output holds a sample's tokens so far).

`pause` is this wrapper's: nothing else drives the in-process engine, so while paused `step` runs no iteration and
the requests in flight stay where they are (vLLM's "keep" pause without its scheduler states); `resume` lets `step`
run again.

Weight pushes without losing work (pause -> `update_weights` -> resume). The engine has a `weight_version` (an int
set by whoever pushes: `update_weights(..., version=v)` or `set_weight_version`), mirrored into vLLM's engine-core
label (`LLMEngine.set_weight_version`), which vLLM records per output token (`CompletionOutput.weight_versions`
spans on a completion's final output). A weight update with requests in flight is allowed only while paused (else
refused: their KV would be a mix of both weights). After loading, the prefix-cache reset preempts every running
request the way vLLM's own memory-pressure preemption does (`Scheduler.reset_prefix_cache(reset_running_requests=
True)`: its KV blocks are freed, `num_computed_tokens` = 0, it goes back to the front of the waiting queue in
order). Nothing is aborted: vLLM keeps each request's output tokens, log-probs, output-processor state and the
model runner's per-request state, its seeded sampling generator included. At the first `step` after `resume` the
scheduler prefills prompt + every token decoded so far with the new weights (one recompute prefill per request:
whole on CPU, where chunked prefill is off; on GPU chunked by vLLM's token budget like any prefill) and samples the
next token from it; the request continues under the same caller id, n > 1 children each on their own, with the same
random stream it would have had without the push (a push of unchanged weights leaves the sampled tokens unchanged).
The caller sees one request: its final `Completion` holds every token, the log-prob each was sampled with (by the
weights that sampled it) and `versions` per token. Every rank of a TP replica preempts and reschedules identically
(same scheduler state); the `resume` digest includes the weight version and how many requests recompute. Refused: a
push with requests in flight while not paused; routed-experts capture (refused by `submit`, so never in flight).

Tensor parallelism under the external launcher: every rank of a TP replica runs its own scheduler and the model's
collectives join them, so the ranks must make the same calls -- submit, abort, pause, resume and as many steps --
with the same arguments in the same order (each rank then schedules, samples and finishes identically). Every call
but `step` checks this: an 8-byte digest of (call, its ordinal, steps run so far, arguments) is all-gathered over the
replica's TP group and a mismatch raises on every rank before vLLM is touched. `step` is not checked per call (one
collective per decoded token); a rank that skipped or added steps is caught at the next checked call.

Not with the request API: routed-experts capture (`return_routed_experts`; `generate` only). The batch `generate`
and `sleep` refuse to run while requests are in flight (`generate` would drain and misreport them; a GPU sleep
aborts them).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional, Sequence

from megarl.platform.megatron_cpu_compat import require_outside_megatron_scope
from megarl.rollout.engine import Completion, GenerationOutput, GenerationRequest, SamplingSettings, plan_prompts


def sampling_params(sampling: SamplingSettings, seed_index: int, output_kind: Optional[str] = None):
    """vLLM `SamplingParams` of prompt `seed_index` of a call with `sampling` (the batch `generate` and `submit`
    share it). `output_kind`: None (vLLM's default; `LLM.generate` sets FINAL_ONLY itself), "final" or
    "cumulative"."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        n=sampling.samples_per_prompt, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, max_tokens=sampling.max_new_tokens, stop=list(sampling.stop) or None,
        stop_token_ids=list(sampling.stop_token_ids) or None, seed=sampling.request_seed(seed_index),
        ignore_eos=sampling.ignore_eos, logprobs=0, flat_logprobs=True, detokenize=bool(sampling.stop),
        prompt_logprobs=0 if sampling.prompt_log_probs else None,
    )
    if output_kind is not None:
        params.output_kind = {"final": RequestOutputKind.FINAL_ONLY,
                              "cumulative": RequestOutputKind.CUMULATIVE}[output_kind]
    return params


def sampled_log_probs(logprobs, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position log-probs (`logprobs=0`: the sampled token only).

    `flat_logprobs=True` gives a `FlatLogprobs` (parallel lists, one entry per position here): read the list
    directly instead of building a dict and a `Logprob` per token (the per-token objects were most of the wrapper's
    cost over a bare `LLM.generate`). Any other container (or a position with more than the sampled token) goes
    through the generic per-position lookup."""
    flat = getattr(logprobs, "logprobs", None)
    if (flat is not None and len(flat) == len(ids) and list(logprobs.token_ids) == ids
            and list(logprobs.start_indices) == list(range(len(ids)))):  # one entry per position: the sampled one
        return [float(v) for v in flat]
    return [float(logprobs[j][t].logprob) for j, t in enumerate(ids)]


def prompt_token_log_probs(logprobs, prompt_ids: list[int]) -> list[float]:
    """[len(prompt_ids) - 1] log p(prompt_ids[j]) at positions j = 1.. from vLLM's `RequestOutput.prompt_logprobs`
    (`prompt_logprobs=0`: each position holds its prompt token; position 0 has none)."""
    if logprobs is None or len(logprobs) != len(prompt_ids):
        raise RuntimeError(f"vLLM returned prompt log-probs for {0 if logprobs is None else len(logprobs)} positions "
                           f"of a {len(prompt_ids)}-token prompt")
    return [float(logprobs[j][prompt_ids[j]].logprob) for j in range(1, len(prompt_ids))]


def _max_prompt(settings: Any, sampling: SamplingSettings) -> int:
    """A request's longest prompt: its sampling settings' `max_prompt_tokens`, else the engine's
    rollout.max_prompt_tokens."""
    return settings.max_prompt_tokens if sampling.max_prompt_tokens is None else sampling.max_prompt_tokens


def check_weight_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"weight version must be an int >= 0, got {version!r}")


@dataclasses.dataclass
class _InFlight:
    request: GenerationRequest
    prompt_ids: list[int]
    completions: dict[int, Completion] = dataclasses.field(default_factory=dict)
    prompt_log_probs: Optional[list[float]] = None

    def output(self, finished: bool) -> GenerationOutput:
        return GenerationOutput(self.request.request_id, list(self.prompt_ids),
                                [self.completions[i] for i in sorted(self.completions)], finished,
                                prompt_log_probs=self.prompt_log_probs if finished else None)


class VllmRequestApi:
    """The request-level API as a mixin of `VllmRolloutEngine` (see the module docstring). Uses the engine's
    `llm`, `settings`, `events` and `tp_agree`; `_init_requests` sets its state up."""

    llm: Any
    settings: Any
    events: Any

    def _init_requests(self) -> None:
        self._requests: dict[str, _InFlight] = {}  # by request id, in submission order
        self._paused = False
        self._request_calls = 0  # ordinal of checked request-API calls (part of the TP digest)
        self._steps = 0  # engine iterations run by `step`
        # submitted (accepted), dropped (prompt policy), finished, aborted: counts of requests over the engine's life
        # recomputed: requests whose KV was dropped by a weight push while they were in flight (recomputed at resume)
        self.request_counts: collections.Counter = collections.Counter(submitted=0, dropped=0, finished=0, aborted=0,
                                                                       recomputed=0)
        self._weight_version = 0
        self._stale_kv: set[str] = set()  # ids of the requests whose KV a push dropped since the last resume
        self.llm.llm_engine.set_weight_version("0")

    # -------------------------------------------------------------------------------------------- state
    @property
    def in_flight(self) -> list[str]:
        """Ids of the requests submitted and neither finished nor aborted, in submission order."""
        return list(self._requests)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine samples with now (0 at start; set by whoever pushes weights)."""
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        """Label the weights now loaded `version` (an int >= 0): tokens sampled from the next step on record it."""
        check_weight_version(version)
        self._weight_version = version
        self.llm.llm_engine.set_weight_version(str(version))

    def _drop_stale_kv(self) -> None:
        """After new weights are loaded: drop the prefix cache and, with requests in flight (paused: checked before
        loading by `_check_push_allowed`), their KV; vLLM recomputes it at their next step (module docstring)."""
        if not self._requests:
            self.llm.reset_prefix_cache()
            return
        if not self._paused:
            raise RuntimeError(self._push_refusal())
        # preempts every running request (blocks freed, recompute from scratch); raises if a block stays in use
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after the weight push although every running "
                               f"request was preempted ({len(self._requests)} in flight)")
        self._stale_kv.update(self._requests)
        self.events.append(("push", len(self._requests)))

    def _push_refusal(self) -> str:
        return (f"a weight update with {len(self._requests)} request(s) of the request API in flight "
                f"({self.in_flight[:5]}...) needs the engine paused: call pause() first, then update_weights, then "
                "resume() (the requests keep their tokens and continue under the new weights)")

    def _check_push_allowed(self, what: str) -> None:
        if self._requests and not self._paused:
            raise RuntimeError(f"{what}: {self._push_refusal()}")
        if self._requests and self.settings.return_routed_experts:  # submit refuses them: cannot happen
            raise NotImplementedError(f"{what}: routed-experts capture cannot span a weight push")

    def _check_same_calls(self, call: str, arguments: Any) -> None:
        """TP > 1: every rank of the replica made this call, with these arguments, as its same-numbered call after
        the same number of steps (see the module docstring); raises ValueError naming the ranks that differ."""
        self._request_calls += 1
        differ = self.tp_agree((call, self._request_calls, self._steps, arguments))
        if differ:
            raise ValueError(f"{call}: ranks {differ} of the TP replica {self.tp_ranks} made a different request-API "
                             f"call, or the same one with other arguments or after another number of steps, than "
                             f"rank {self.tp_ranks[0]} (call {self._request_calls}, {self._steps} steps here); every "
                             "rank of a replica must submit, abort, pause, resume and step identically, in order")

    def _refuse_while_in_flight(self, what: str) -> None:
        if self._requests:
            raise RuntimeError(f"{what}: {len(self._requests)} request(s) of the request API are in flight "
                               f"({self.in_flight[:5]}...); poll them to the end or abort them first")

    # -------------------------------------------------------------------------------------------- calls
    def submit(self, requests: Sequence[GenerationRequest]) -> list[str]:
        """Queue `requests` for generation (see `RolloutEngine.submit`); returns the ids the prompt policy dropped
        (`overlong_prompt: drop`: longer than max_prompt_tokens; they produce no output). Raises before queueing
        anything on a duplicate id, a request that cannot fit max_model_len, or (TP > 1) calls that differ
        between the replica's ranks."""
        require_outside_megatron_scope("rollout engine submit")
        requests = list(requests)
        self._check_same_calls("submit", [(r.request_id, list(r.prompt_ids), r.sampling, r.seed_index, r.stream)
                                          for r in requests])
        s = self.settings
        if s.return_routed_experts:
            raise NotImplementedError("routed-experts capture (algorithm.router_replay: rollout) runs through the "
                                      "batch generate only, not the request API")
        ids = [r.request_id for r in requests]
        clash = sorted({i for i in ids if ids.count(i) > 1} | (set(ids) & set(self._requests)))
        if clash:
            raise ValueError(f"submit: request ids {clash[:10]} are repeated or already in flight")
        limits = [_max_prompt(s, r.sampling) for r in requests]
        for r, max_prompt in zip(requests, limits):
            if max_prompt + r.sampling.max_new_tokens > s.max_model_len:
                raise ValueError(f"submit: request {r.request_id!r}: its max_prompt_tokens ({max_prompt}: the "
                                 "request's sampling.max_prompt_tokens, else rollout.max_prompt_tokens) + "
                                 f"max_new_tokens ({r.sampling.max_new_tokens}) exceeds the engine's max_model_len "
                                 f"({s.max_model_len})")
        # the prompt policy per request, each against its own limit (an episode's later turns are longer than
        # rollout.max_prompt_tokens and say so in their sampling settings, as the batch path's continuations do)
        plans = [plan_prompts([list(r.prompt_ids)], max_prompt, s.overlong_prompt)
                 for r, max_prompt in zip(requests, limits)]
        engine = self.llm.llm_engine
        dropped = []
        for r, plan in zip(requests, plans):
            if not plan.kept_indices:
                dropped.append(r.request_id)
                continue
            prompt = plan.prompts[0]
            params = sampling_params(r.sampling, r.seed_index, "cumulative" if r.stream else "final")
            # rendered as LLM.generate renders a token prompt, then added under the caller's id
            engine.add_request(r.request_id, self.llm._preprocess_cmpl_one({"prompt_token_ids": prompt}), params,
                               lora_request=self._lora_request)
            self._requests[r.request_id] = _InFlight(r, prompt)
        self.request_counts["submitted"] += len(requests) - len(dropped)
        self.request_counts["dropped"] += len(dropped)
        self.events.append(("submit", len(requests)))
        return dropped

    def step(self) -> list[GenerationOutput]:
        """One engine iteration (none while paused or with nothing in flight): the outputs of the requests that
        finished in it (then gone from the engine) and partial outputs of streamed requests that made progress."""
        if self._paused or not self._requests:
            return []
        self._steps += 1
        results = []
        for out in self.llm.llm_engine.step():
            flight = self._requests.get(out.request_id)
            if flight is None:  # not a request of this API (none can be: generate refuses to run beside them)
                raise RuntimeError(f"step: vLLM returned an output for unknown request {out.request_id!r}")
            for c in out.outputs:
                ids = list(c.token_ids)
                if c.finished() and c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished request {out.request_id!r} sample {c.index} with "
                                       f"{c.finish_reason!r}")
                flight.completions[c.index] = Completion(c.index, ids, sampled_log_probs(c.logprobs, ids),
                                                         c.finish_reason if c.finished() else None,
                                                         self._token_versions(flight, out.request_id, c, ids))
            if out.finished:
                if flight.request.sampling.prompt_log_probs:
                    flight.prompt_log_probs = prompt_token_log_probs(out.prompt_logprobs, flight.prompt_ids)
                del self._requests[out.request_id]
                self.request_counts["finished"] += 1
                results.append(flight.output(finished=True))
            elif flight.request.stream:
                results.append(flight.output(finished=False))
        return results

    def _token_versions(self, flight: _InFlight, request_id: str, c: Any, ids: list[int]) -> list[int]:
        """[len(ids)] the weight version that sampled each token: vLLM's spans on a completion's final output; on a
        streamed partial, the versions reported before plus the current one for the tokens new in this step (a step
        runs under one version: weights change only while paused)."""
        spans = getattr(c, "weight_versions", None) if c.finished() else None
        if spans is not None:
            versions = [int(sp.version) for sp in spans for _ in range(sp.start, sp.end)]
            if len(versions) != len(ids):
                raise RuntimeError(f"request {request_id!r} sample {c.index}: vLLM's weight-version spans cover "
                                   f"{len(versions)} of its {len(ids)} tokens")
            return versions
        if c.finished() and not flight.request.stream:
            raise RuntimeError(f"request {request_id!r} sample {c.index} finished without vLLM weight-version spans")
        prev = flight.completions.get(c.index)
        known = list(prev.versions) if prev is not None and prev.versions is not None else []
        return known[:len(ids)] + [self._weight_version] * max(0, len(ids) - len(known))

    def poll(self, min_finished: int = 1) -> list[GenerationOutput]:
        """`step` until `min_finished` requests finished (in these steps), none is left in flight, or the engine is
        paused; returns every output of those steps in order (finished ones and streamed partials)."""
        out: list[GenerationOutput] = []
        finished = 0
        while self._requests and not self._paused and finished < min_finished:
            got = self.step()
            out += got
            finished += sum(o.finished for o in got)
            if self._requests and not self.llm.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"poll: vLLM holds none of the {len(self._requests)} requests in flight "
                                   f"({self.in_flight[:5]}...)")
        return out

    def abort(self, request_ids: Sequence[str]) -> int:
        """Remove these requests from the engine (ids not in flight are ignored); no output will come for them.
        Returns how many were in flight (added to `request_counts["aborted"]`)."""
        request_ids = list(request_ids)
        self._check_same_calls("abort", request_ids)
        live = [i for i in dict.fromkeys(request_ids) if i in self._requests]
        if live:
            self.llm.llm_engine.abort_request(live)  # the caller's ids; vLLM aborts their internal (child) requests
        for i in live:
            del self._requests[i]
        self.request_counts["aborted"] += len(live)
        self.events.append(("abort", len(live)))
        return len(live)

    def pause(self) -> None:
        """Hold the requests in flight with their progress: `step`/`poll` run nothing until `resume`; `submit`,
        `abort` and a weight update (`update_weights`, the requests stay in flight) still work."""
        self._check_same_calls("pause", None)
        self._paused = True
        self.events.append(("pause", len(self._requests)))

    def resume(self) -> None:
        """Let `step`/`poll` run the held requests again. After a weight push the requests that were in flight
        continue from the tokens they have: their next step recomputes prompt + tokens so far under the new weights
        (one prefill each, by vLLM's preemption-recompute; see the module docstring). TP > 1: the ranks must agree
        on the weight version and on how many requests recompute (checked)."""
        recompute = sum(i in self._stale_kv for i in self._requests)  # not those aborted since the push
        self._check_same_calls("resume", (self._weight_version, recompute))
        self._paused = False
        self.request_counts["recomputed"] += recompute
        self._stale_kv = set()
        self.events.append(("resume", len(self._requests)))
