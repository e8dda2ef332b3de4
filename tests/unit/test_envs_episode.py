"""Multi-turn episodes (`megarl.envs.episode`): masks, token exactness against transformers' own rendering of the
final conversation, the separator after each end-of-turn token, verification failing on an injected
retokenization, templates that rewrite earlier turns, limits.

The engine is a scripted `RolloutClient` (`tests.episode_helpers.ScriptedClient`: what a policy that has learned to
call the calculator would sample; the real engine runs in tests/e2e/test_multi_turn.py); the tokenizer, its chat
template and the rendering are transformers' own.
"""

from __future__ import annotations

import json
import re

import pytest

from megarl.data.chat_chars import build_chat_char_tokenizer
from megarl.data.dataset import PromptRecord
from megarl.envs.base import EnvStep, EpisodeError
from megarl.envs.episode import ChatRenderer, EpisodeLimits, EpisodeRunner, TemplateMismatch, verify_trajectory
from megarl.rollout.engine import SamplingSettings
from tests.episode_helpers import ScriptedClient

TOK = build_chat_char_tokenizer()
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]


def parse(text: str):
    calls, errors = [], []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        try:
            calls.append(json.loads(body))
        except json.JSONDecodeError as e:
            errors.append(f"malformed tool call: {e}")
    return calls, errors


class CalcEnv:
    """Reset: the question; a turn with tool calls gets the product as a tool message; a turn without ends the
    episode, reward 1 when it is the product."""

    def __init__(self, record):
        self.record = record

    async def reset(self, record):
        return [{"role": "user", "content": record.prompt}]

    def tools(self):
        return TOOLS

    async def step(self, turn):
        if turn.parse_errors:
            return EnvStep(({"role": "tool", "name": "calculator", "content": "Error: " + turn.parse_errors[0]},),
                           info={"tool_errors": 1})
        if turn.tool_calls:
            a, b = (int(x) for x in turn.tool_calls[0]["arguments"]["expression"].split("*"))
            return EnvStep(({"role": "tool", "name": "calculator", "content": str(a * b)},), info={"tool_calls": 1})
        assert "<|im_end|>" not in turn.text  # the end-of-turn token is not part of the text read
        return EnvStep(reward=float(turn.text == self.record.answer), done=True)

    async def close(self):
        pass


def fixed_log_probs(request, n: int) -> list[float]:
    """Log-prob of token j of every turn: -(j + 1) / 100."""
    return [-(j + 1) / 100 for j in range(n)]


class ScriptedPolicy(ScriptedClient):
    """The first turn calls the calculator (or writes `first` when given), a turn after a tool result answers with
    it (+ `answer_suffix`); every turn ends with <|im_end|>; log-probs `fixed_log_probs`; no weights version of its
    own (the runner's policy_version is recorded). `requests`: every request, one per episode-turn."""

    def __init__(self, first=None, answer_suffix=""):
        super().__init__(TOK, self.write, log_probs=fixed_log_probs)
        self.first, self.answer_suffix = first, answer_suffix

    def write(self, text: str) -> str:
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        if results:
            return results[-1] + self.answer_suffix
        question = re.search(r"user\n(\d+)\*(\d+)=", text)
        return self.first or ('<tool_call>{"name": "calculator", "arguments": {"expression": "%s*%s"}}'
                              '</tool_call>' % question.groups())


LIMITS = EpisodeLimits(max_turns=3, max_tokens_per_turn=128, max_new_tokens=256, max_model_len=1024)


def runner(limits=LIMITS, **kw):
    return EpisodeRunner(TOK, CalcEnv, parse, limits, **kw)


RECORDS = [PromptRecord(0, "12*34=", "408", {}), PromptRecord(1, "7*8=", "56", {})]


def run(r, policy, records=RECORDS, n=2):
    return r.run(records, n, policy, SamplingSettings(seed=3), policy_version=5, uid_prefix="s1/")


def test_two_turn_episode_is_the_templates_rendering_token_for_token_with_the_policys_tokens_masked_in():
    policy = ScriptedPolicy()
    result = run(runner(), policy)
    assert result.scores == [1.0, 1.0, 1.0, 1.0]
    for t, record in zip(result.trajectories, [r for r in RECORDS for _ in range(2)]):
        a, b = record.prompt[:-1].split("*")
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s*%s"}}</tool_call>' % (a, b)
        conversation = [{"role": "user", "content": record.prompt}, {"role": "assistant", "content": call},
                        {"role": "tool", "name": "calculator", "content": record.answer},
                        {"role": "assistant", "content": record.answer}]
        text = TOK.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
        assert text.endswith("<|im_end|>\n")  # the template's separator after the last turn, never sampled
        expected = TOK(text[:-1], add_special_tokens=False)["input_ids"]
        assert t.token_ids == expected
        # loss mask: 1 exactly on the two sampled turns (content + <|im_end|>), 0 on the separator and the tool turn
        sampled = [TOK(call, add_special_tokens=False)["input_ids"] + [2],
                   TOK(record.answer, add_special_tokens=False)["input_ids"] + [2]]
        masked = [tok for tok, m in zip(t.token_ids, t.loss_mask) if m]
        assert masked == sampled[0] + sampled[1]
        first_end = t.token_ids.index(2, t.prompt_len)  # the first sampled turn's <|im_end|>
        assert t.loss_mask[first_end] == 1 and t.token_ids[first_end + 1] == TOK.convert_tokens_to_ids("\n")
        assert t.loss_mask[first_end + 1] == 0  # the separator is context (verl PR #6921's lost token)
        assert {v for v, m in zip(t.policy_version, t.loss_mask) if m} == {5}
        assert [lp for lp, m in zip(t.log_probs, t.loss_mask) if m] == \
            [-(j + 1) / 100 for j in range(len(sampled[0]))] + [-(j + 1) / 100 for j in range(len(sampled[1]))]
    assert [t.group_uid for t in result.trajectories] == ["s1/0", "s1/0", "s1/1", "s1/1"]
    assert result.metrics["multi_turn/turns_mean"] == 2 and result.metrics["multi_turn/tool_use_frac"] == 1
    assert result.metrics["multi_turn/tool_success_frac"] == 1
    assert len(policy.requests) == 8  # one request per episode-turn: 4 episodes x 2 turns


def test_an_injected_retokenization_is_caught_naming_the_trajectory_and_turn(monkeypatch):
    import megarl.envs.episode as episode

    class Retokenizing(episode.TrajectoryBuilder):
        def sampled(self, ids, log_probs, policy_version):  # decode and re-encode, dropping the special end token
            again = TOK(TOK.decode(ids, skip_special_tokens=True), add_special_tokens=False)["input_ids"]
            versions = policy_version if isinstance(policy_version, int) else list(policy_version)[:len(again)]
            return super().sampled(again, list(log_probs)[:len(again)], versions)

    monkeypatch.setattr(episode, "TrajectoryBuilder", Retokenizing)
    with pytest.raises(EpisodeError, match=r"episode s1/0/0, turn 0"):
        run(runner(), ScriptedPolicy())
    with pytest.raises(EpisodeError, match=r"trajectory s1/0/0, turn 0"):
        run(runner(limits=EpisodeLimits(max_turns=1, max_tokens_per_turn=128, max_new_tokens=256,
                                        max_model_len=1024)), ScriptedPolicy())


def test_verify_trajectory_checks_the_engines_tokens_and_the_mask():
    result = run(runner(), ScriptedPolicy())
    t, turns = result.trajectories[0], result.turns[0]
    verify_trajectory(t, turns)
    given, produced, lps = turns[1]
    with pytest.raises(EpisodeError, match="turn 1: the tokens the engine was given"):
        verify_trajectory(t, turns[:1] + [(given[:-1] + [given[-1] + 1], produced, lps)])
    with pytest.raises(EpisodeError, match="turn 1: the rollout log-probs"):
        verify_trajectory(t, turns[:1] + [(given, produced, [x + 1 for x in lps])])
    import dataclasses

    separator = t.token_ids.index(2, t.prompt_len) + 1  # the "\n" after the first sampled turn: context
    leaky = dataclasses.replace(t, loss_mask=[1 if i == separator else m for i, m in enumerate(t.loss_mask)],
                                log_probs=[-1.0 if i == separator else x for i, x in enumerate(t.log_probs)],
                                policy_version=[5 if i == separator else v for i, v in enumerate(t.policy_version)])
    with pytest.raises(EpisodeError, match="context tokens would be trained on"):
        verify_trajectory(leaky, turns)


THINK_DROPPING = ("{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{%- if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
                  "{%- else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                  "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_refused_or_masked_and_counted():
    with pytest.raises(TemplateMismatch, match="not prefix-stable"):
        ChatRenderer(TOK, TOOLS, THINK_DROPPING).check_prefix_stable()
    ChatRenderer(TOK, TOOLS).check_prefix_stable()  # the shipped template only appends
    policy = ScriptedPolicy(first='<think>hm</think><tool_call>{"name": "calculator", "arguments": '
                                  '{"expression": "12*34"}}</tool_call>')
    with pytest.raises(TemplateMismatch, match="episode s1/0/0, turn 0"):
        run(runner(chat_template=THINK_DROPPING), policy, RECORDS[:1])
    result = run(runner(chat_template=THINK_DROPPING, on_template_mismatch="mask"), policy, RECORDS[:1])
    assert result.metrics["multi_turn/template_mismatch"] == 2
    assert all(sum(t.loss_mask) == 0 for t in result.trajectories)


def test_limits_end_episodes_and_are_counted():
    tight = EpisodeLimits(max_turns=1, max_tokens_per_turn=128, max_new_tokens=256, max_model_len=1024)
    result = run(runner(limits=tight), ScriptedPolicy())  # the answer turn never comes
    assert all(t.finish_reason == "length" for t in result.trajectories)
    assert result.metrics["multi_turn/truncated_frac"] == 1.0 and result.scores == [0.0] * 4
    short = EpisodeLimits(max_turns=3, max_tokens_per_turn=10, max_new_tokens=256, max_model_len=1024)
    result = run(runner(limits=short), ScriptedPolicy())  # the tool call is cut at 10 tokens
    assert all(sum(t.loss_mask) == 10 and t.finish_reason == "length" for t in result.trajectories)


def test_a_malformed_tool_call_is_an_observation_and_counted():
    policy = ScriptedPolicy(first="<tool_call>{not json</tool_call>", answer_suffix="")
    result = run(runner(), policy, RECORDS[:1], n=1)
    t = result.trajectories[0]
    assert "Error: malformed tool call" in TOK.decode(t.token_ids, skip_special_tokens=False)
    assert result.metrics["multi_turn/parse_errors"] == 1 and result.metrics["multi_turn/tool_errors"] == 1
    assert result.metrics["multi_turn/tool_use_frac"] == 1 and result.metrics["multi_turn/tool_success_frac"] == 0


def test_a_turn_asks_for_no_more_tokens_than_its_episode_has_left():
    """An episode with fewer tokens left than max_tokens_per_turn asks for that many: the answer turn ("408" + end
    token) of an episode with 2 tokens left is cut to them, finish_reason 'length'."""
    call = len(TOK('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
                   add_special_tokens=False)["input_ids"]) + 1
    tight = EpisodeLimits(max_turns=3, max_tokens_per_turn=128, max_new_tokens=call + 2, max_model_len=1024)
    policy = ScriptedPolicy()
    result = runner(limits=tight).run(RECORDS[:1], 1, policy, SamplingSettings(seed=3), 0)
    t = result.trajectories[0]
    assert sum(t.loss_mask) == call + 2 and t.finish_reason == "length" and result.scores == [0.0]
    assert [r.sampling.max_new_tokens for r, _ in policy.requests] == [call + 2, 2]  # all it has left, each turn


class ChattyEnv(CalcEnv):
    """Answers every turn with a user message until the third turn."""

    async def step(self, turn):
        if turn.index >= 2:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(({"role": "user", "content": "go on"},))


def test_a_turn_cut_at_its_token_limit_is_closed_as_context_and_the_episode_goes_on():
    policy = ScriptedPolicy(first="x" * 30, answer_suffix="")
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=6, max_new_tokens=256, max_model_len=1024)
    r = EpisodeRunner(TOK, ChattyEnv, parse, limits)
    result = r.run(RECORDS[:1], 1, policy, SamplingSettings(seed=0), 0)
    t = result.trajectories[0]
    assert result.metrics["multi_turn/turns_mean"] == 3 and result.metrics["multi_turn/turns_cut"] == 2
    assert sum(t.loss_mask) == 6 * 3 and result.scores == [1.0]
    conversation = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "x" * 6},
                    {"role": "user", "content": "go on"}, {"role": "assistant", "content": "x" * 6},
                    {"role": "user", "content": "go on"}]
    expected = TOK(TOK.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
    assert t.token_ids[:len(expected)] == expected  # the closing <|im_end|> is where the template puts it ...
    closing = [i for i, tok in enumerate(t.token_ids) if tok == TOK.eos_token_id and i > t.prompt_len]
    assert all(t.loss_mask[i] == 0 for i in closing[:2])  # ... as context: the policy did not sample it


# ---- a real BPE vocabulary (byte-level, trained with `tokenizers`): sampled ids need not be canonical -------------

BPE = __import__("megarl.data.chat_bpe", fromlist=["x"]).build_chat_bpe_tokenizer()
BPE_ROWS = len(BPE) + 16  # a model's embedding rows padded past the tokenizer (as Qwen's are)


def byte_ids(text: str) -> list[int]:
    """`text` as one id per byte: a valid encoding that decodes to `text`, never the canonical one where BPE merges."""
    return [i for ch in text for i in BPE(ch, add_special_tokens=False)["input_ids"]]


class NonCanonicalPolicy(ScriptedClient):
    """The calculator policy over the BPE vocabulary, sampling what a model may: the tool call byte by byte (not
    the merged encoding `BPE(text)` gives), the answer with an id beyond the tokenizer (decodes to nothing) in
    front; each turn ends with <|im_end|>."""

    def __init__(self):
        super().__init__(BPE, reply_ids=self.write, log_probs=lambda request, n: [-0.5] * n)

    @staticmethod
    def write(prompt_ids: list) -> list:
        text = BPE.decode(prompt_ids, skip_special_tokens=False)
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        if results:
            return [BPE_ROWS - 1] + BPE(results[-1], add_special_tokens=False)["input_ids"]
        a, b = re.search(r"user\n(\d+)\*(\d+)=", text).groups()
        return byte_ids('<tool_call>{"name": "calculator", "arguments": {"expression": "%s*%s"}}</tool_call>' % (a, b))


def test_non_canonical_and_undecodable_sampled_ids_are_kept_as_sampled_and_counted_not_masked():
    """Issue 29: on a BPE vocabulary a sampled turn rarely re-encodes to itself; the episode is trained on the ids as
    sampled, every token the template adds is checked, and the turns are counted. Expected values: the tool call's
    canonical encoding is shorter (BPE merges, so byte-by-byte is non-canonical), the decoded trajectory is
    transformers' own rendering of the conversation, and the trained ids are exactly the policy's."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    assert len(BPE(call, add_special_tokens=False)["input_ids"]) < len(byte_ids(call))  # the premise: merges exist
    policy = NonCanonicalPolicy()
    result = EpisodeRunner(BPE, CalcEnv, parse, LIMITS).run(RECORDS, 2, policy, SamplingSettings(seed=3), 7)
    assert result.scores == [1.0] * 4
    m = result.metrics
    assert m["multi_turn/template_mismatch"] == 0 and m["multi_turn/turns_mean"] == 2
    assert m["multi_turn/noncanonical_turns"] == 4 and m["multi_turn/undecodable_turns"] == 4  # 4 episodes x 1 each
    for t, record in zip(result.trajectories, [r for r in RECORDS for _ in range(2)]):
        assert sum(t.loss_mask) > 0  # trained, not masked
        a, b = record.prompt[:-1].split("*")
        conversation = [{"role": "user", "content": record.prompt},
                        {"role": "assistant", "content": call.replace("12*34", f"{a}*{b}")},
                        {"role": "tool", "name": "calculator", "content": record.answer},
                        {"role": "assistant", "content": record.answer}]
        text = BPE.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
        assert BPE.decode(t.token_ids, skip_special_tokens=False) == text[:-1]  # all but the final separator
        trained = [tok for tok, keep in zip(t.token_ids, t.loss_mask) if keep]
        first = byte_ids(call.replace("12*34", f"{a}*{b}")) + [BPE.eos_token_id]
        second = [BPE_ROWS - 1] + BPE(record.answer, add_special_tokens=False)["input_ids"] + [BPE.eos_token_id]
        assert trained == first + second


def test_on_a_bpe_vocabulary_a_template_delta_other_than_the_templates_is_still_caught(monkeypatch):
    """The separator after the end-of-turn token dropped from the observation tokens (verl PR #6921's bug): the
    tokens the template adds are not the ones held, whatever the sampled ids' encoding."""
    original = ChatRenderer.observation

    def without_separator(self, conversation, observations, end_id):
        return original(self, conversation, observations, end_id)[1:]

    monkeypatch.setattr(ChatRenderer, "observation", without_separator)
    with pytest.raises(TemplateMismatch, match=r"episode s1/0/0, turn 0: the template renders"):
        EpisodeRunner(BPE, CalcEnv, parse, LIMITS).run(RECORDS, 2, NonCanonicalPolicy(), SamplingSettings(seed=3),
                                                       7, uid_prefix="s1/")


class HangingEnv(CalcEnv):
    """A step that never returns for record 0; a reset that never returns for record 9."""

    async def reset(self, record):
        import asyncio

        if record.index == 9:
            await asyncio.Event().wait()
        return await super().reset(record)

    async def step(self, turn):
        import asyncio

        if self.record.index == 0:
            await asyncio.Event().wait()
        return await super().step(turn)


def test_an_environment_call_that_does_not_return_is_bounded_counted_or_named():
    """A hung step is cancelled at env_timeout_s and ends its episode (trained on nothing), counted; the other
    episodes go on. A hung reset stops the run naming the episode."""
    r = EpisodeRunner(TOK, HangingEnv, parse, LIMITS, env_timeout_s=0.2)
    result = run(r, ScriptedPolicy())
    assert result.metrics["multi_turn/step_timeouts"] == 2 and result.metrics["multi_turn/tool_timeouts"] == 2
    assert result.scores == [0.0, 0.0, 1.0, 1.0]
    assert [sum(t.loss_mask) == 0 for t in result.trajectories] == [True, True, False, False]
    with pytest.raises(EpisodeError, match=r"episode s1/1/0: reset: the environment did not return within "
                                           r"0.2 s \(rollout.env_timeout_s\)"):
        run(r, ScriptedPolicy(), [RECORDS[0], PromptRecord(9, "2*2=", "4", {})])
