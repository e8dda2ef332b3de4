"""A distillation teacher served on vLLM engines (`distillation.teachers.<name>.backend: vllm`): the log-probs of the
student's sampled tokens read from the teacher engine's prompt log-probs.

    teacher = EngineTeacher("big", client, max_concurrent=64, timeout_s=600)   # client: a RolloutClient
    log_probs = teacher.log_probs(input_ids, attention_mask, loss_mask)      # [B, S] float32, 0 off the loss mask

Each row is one request: its prompt is the row's tokens (the attention-mask positions, prompt and response: the
student's own ids, never re-tokenized), one new token, `SamplingSettings.prompt_log_probs` (vLLM `prompt_logprobs=0`:
the raw log-softmax of the teacher's logits at each position, the same path the judge's yes/no log-probs take,
`megarl.rollout.judge`). Position j of the row gets log p(token j | tokens before it), as the Megatron teacher's
token-aligned log-probs do; positions off the loss mask get 0 (the prompt, the environment's observation tokens,
padding).

The engines are never weight-synced and serve for the whole run (`megarl.workers.teacher_host.TeacherEngineHost` on
the teacher's pool). Unlike the judge's, a failed request is not scored by a fallback: the training step fails,
naming the teacher and the row (a missing teacher log-prob has no neutral value).

Nothing here imports vLLM or Ray: the client is any `RolloutClient` (`RolloutRouter` over the engine servers,
`megarl.controller.serving`; `InProcessClient` in tests).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid

import torch

from megarl.rollout.engine import GenerationRequest, SamplingSettings


class EngineTeacher:
    """The controller side of one vLLM-served teacher (see the module docstring). Thread-safe: each call runs its
    requests on an event loop of its own (`asyncio.run` on the calling thread, which must run no event loop: the
    training step's thread runs none in any mode -- the async modes' rollout driver and one_step_off's producer run
    their loops on threads of their own -- and the router settles each request on the loop that made it)."""

    def __init__(self, name: str, client, *, max_concurrent: int, timeout_s: float) -> None:
        """`client`: a `RolloutClient` over the teacher's engines; `max_concurrent`: requests in flight at most;
        `timeout_s`: the bound of each request (seconds)."""
        if max_concurrent < 1:
            raise ValueError(f"EngineTeacher {name!r}: max_concurrent must be >= 1, got {max_concurrent}")
        self.name = name
        self.client = client
        self.max_concurrent = max_concurrent
        self.timeout_s = timeout_s
        self._prefix = f"teacher-{name}-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()
        self.requests = 0  # requests sent so far (one per row with at least one loss-mask token)

    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  loss_mask: torch.Tensor) -> torch.Tensor:
        """[B, S] int ids, attention mask (1 = a real token) and loss mask (1 = a token the student sampled) ->
        [B, S] float32: the teacher's log p(input_ids[b, j] | the row's tokens before j) at each loss-mask position,
        0 elsewhere."""
        if not (input_ids.shape == attention_mask.shape == loss_mask.shape) or input_ids.dim() != 2:
            raise ValueError(f"teacher {self.name!r}: input_ids, attention_mask and loss_mask must be [B, S] of one "
                             f"shape; got {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}, "
                             f"{tuple(loss_mask.shape)}")
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        rows = []
        for b in range(input_ids.shape[0]):
            positions = attention_mask[b].nonzero().flatten()
            if bool(loss_mask[b].bool().any()):
                if bool((loss_mask[b].bool() & ~attention_mask[b].bool()).any()):
                    raise ValueError(f"teacher {self.name!r}: row {b} has loss-mask tokens outside its attention "
                                     "mask")
                rows.append((b, positions))
        results = asyncio.run(self._score_rows([(b, input_ids[b, p].tolist()) for b, p in rows]))
        for (b, positions), values in zip(rows, results):
            out[b, positions[1:]] = torch.tensor(values, dtype=torch.float32)
        return out * loss_mask.to(torch.float32)

    async def _score_rows(self, rows: list[tuple[int, list[int]]]) -> list[list[float]]:
        semaphore = asyncio.Semaphore(self.max_concurrent)
        sampling = SamplingSettings(temperature=0.0, max_new_tokens=1, seed=0, prompt_log_probs=True)

        async def one(row: int, ids: list[int]) -> list[float]:
            request = GenerationRequest(f"{self._prefix}{next(self._ids)}", ids, sampling)
            async with semaphore:
                self.requests += 1
                try:
                    result = await self.client.generate(request, session_id=None, timeout_s=self.timeout_s)
                except Exception as e:
                    raise RuntimeError(f"teacher {self.name!r}: the prompt log-probs request of row {row} "
                                       f"({len(ids)} tokens) failed: {type(e).__name__}: {e}") from e
            got = result.prompt_log_probs
            if got is None or len(got) != len(ids) - 1:
                raise RuntimeError(f"teacher {self.name!r}: the engine returned "
                                   f"{'no' if got is None else len(got)} prompt log-probs for row {row} of "
                                   f"{len(ids)} tokens (expected {len(ids) - 1})")
            return got

        return list(await asyncio.gather(*(one(b, ids) for b, ids in rows)))
