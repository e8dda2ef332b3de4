"""The tool quickstart's SFT demonstrations (`megarl.trainer.tool_quickstart.demonstration`) hold exactly the tokens
its greedy episodes feed the model for the same conversation: the episode runner of the quickstart's own config
(`yaml_configs/cpu_tools_quickstart.yaml`: the calculator environment without a system prompt, the hermes parser,
the tokenizer's ChatML template, its limits), driven by a client that samples what the demonstration teaches.

Expected tokens are written out by hand as ChatML text (`megarl.data.chat_chars`: one id per character), not
rendered by the code under test: a context the episodes build differently from the demonstrations (a separator, the
tool schema, the observation's role or text, the generation prompt) is a context the warmed-up model never trained
on, and the quickstart's after-SFT accuracy falls while every tool call still parses and runs.
"""

from __future__ import annotations

import asyncio
import json
import re

import yaml

from megarl.config.loader import apply_overrides, parse_config
from megarl.config.validate import validate
from megarl.data.arithmetic import MODEL_VOCAB
from megarl.data.chat_chars import build_chat_char_tokenizer
from megarl.data.dataset import PromptRecord
from megarl.data.tokenization import PromptEncoder
from megarl.data.tool_task import MODEL_SHAPE
from megarl.envs.episode import runner_from_config
from megarl.rewards.registry import get_reward
from megarl.rollout.engine import Completion, GenerationOutput, SamplingSettings
from megarl.trainer.tool_quickstart import CONFIG, demonstration

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
# the whole demonstrated conversation, as the ChatML template of chat_chars renders it
PROMPT = ("<|im_start|>system\nTools: calculator<|im_end|>\n"
          "<|im_start|>user\n37*48=<|im_end|>\n"
          "<|im_start|>assistant\n")
AFTER_CALL = "<|im_end|>\n<|im_start|>tool\n1776<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "1776"


class DemonstratedPolicy:
    """A `RolloutClient` sampling what the demonstrations teach: the calculator call for the question, then the
    tool's result; records the prompt ids of every request."""

    replicas = 1
    weight_version = 0

    def __init__(self, tokenizer):
        self.tokenizer, self.prompts = tokenizer, []

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        await asyncio.sleep(0)
        prompt = list(request.prompt_ids)
        self.prompts.append(prompt)
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
        reply = results[-1] if results else CALL
        ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return GenerationOutput(request.request_id, prompt, [Completion(0, ids, [-0.5] * len(ids), "stop")], True)

    async def abort(self, request_ids):
        return 0


def quickstart_runner(tmp_path):
    """The quickstart's episode runner, built from its config the way `run_tool_quickstart` builds it."""
    tok = build_chat_char_tokenizer(str(tmp_path / "model"))
    # the model's architecture only (the config checks read it; no weights are loaded)
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": MODEL_VOCAB, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "torch_dtype": "float32", **MODEL_SHAPE}))
    for split in ("train", "val"):
        (tmp_path / f"{split}.jsonl").write_text('{"prompt": "37*48=", "answer": "1776"}\n')
    raw = apply_overrides(yaml.safe_load(open(CONFIG)), [
        f"model.path={tmp_path / 'model'}", f"data.train_path={tmp_path / 'train.jsonl'}",
        f"data.val_path={tmp_path / 'val.jsonl'}", f"logging.dir={tmp_path}"])
    cfg = validate(parse_config(raw))
    encoder = PromptEncoder(tok, cfg.data.chat_template)
    return tok, runner_from_config(cfg, encoder, get_reward(cfg.reward.function))


def ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_demonstration_is_the_episode_the_quickstart_runs(tmp_path):
    tok, runner = quickstart_runner(tmp_path)
    record = PromptRecord(0, "37*48=", "1776", {"prompt": "37*48=", "answer": "1776"})
    eos = tok.eos_token_id
    prompt, call, after_call, answer = ids(tok, PROMPT), ids(tok, CALL), ids(tok, AFTER_CALL), ids(tok, ANSWER)
    assert after_call[0] == eos  # the call's end-of-turn token is sampled; the rest of AFTER_CALL is context

    demo = demonstration(tok, record, runner.env_factory(record).tools())
    assert list(demo.token_ids) == prompt + call + after_call + answer + [eos]
    assert list(demo.loss_mask) == ([0] * len(prompt) + [1] * (len(call) + 1) + [0] * (len(after_call) - 1)
                                    + [1] * (len(answer) + 1))

    policy = DemonstratedPolicy(tok)
    result = runner.run([record], 1, policy, SamplingSettings(temperature=0.0, seed=0), 0, uid_prefix="eval/")
    # what the model is fed at each turn: the demonstration's context before each of its sampled turns
    assert policy.prompts == [prompt, prompt + call + after_call]
    episode = result.trajectories[0]
    assert list(episode.token_ids) == list(demo.token_ids)
    assert list(episode.loss_mask) == list(demo.loss_mask)
    assert result.scores == [1.0]
    assert result.metrics["multi_turn/tool_success_frac"] == 1.0
