"""The tool quickstart's evaluation (`megarl.trainer.tool_quickstart.greedy_episodes`): greedy episodes of every
held-out record through a `RolloutService`'s request servers, with the GRPO job's own runner (`runner_from_config` on
yaml_configs/cpu_tools_quickstart.yaml: the calculator environment, the hermes parser, the exact-match reward).

The service's client is scripted (`tests.episode_helpers.ScriptedClient`): a policy that calls the calculator on
the problems whose first factor is even and answers the others "0" at once, then answers with what the tool said.
The expected accuracy is computed here from the records alone (the fraction whose first factor is even): an eval
that did not read the tool's result, did not run the calculator, or scored something else would not give it. The
quickstart itself (Ray, Megatron, vLLM) runs end to end as `megarl quickstart --task tools`.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import yaml

from megarl.config.loader import parse_config
from megarl.data.chat_chars import build_chat_char_tokenizer
from megarl.data.dataset import PromptRecord
from megarl.data.tokenization import PromptEncoder
from megarl.data.tool_task import problems, tool_call_text
from megarl.envs.episode import runner_from_config
from megarl.rewards import build_reward_fn
from megarl.trainer.tool_quickstart import CONFIG, greedy_episodes
from tests.episode_helpers import ScriptedClient

TOK = build_chat_char_tokenizer()


def even_caller(text: str) -> str:
    """Call the calculator when the question's first factor is even (else answer "0"); after a tool result, answer
    with it."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
    if results:
        return results[-1]
    a, b = re.search(r"user\n(\d+)\*(\d+)=", text).groups()
    return tool_call_text(f"{a}*{b}") if int(a) % 2 == 0 else "0"


class ServingService:
    """A `RolloutService`'s `serving()`: yields `client`, counting the phases entered and left."""

    def __init__(self, client) -> None:
        self.client, self.entered, self.left = client, 0, 0

    @contextlib.contextmanager
    def serving(self):
        self.entered += 1
        try:
            yield self.client
        finally:
            self.left += 1


def test_greedy_episodes_score_what_the_tool_answered_through_the_services_client():
    cfg = parse_config(yaml.safe_load(open(CONFIG)))
    runner = runner_from_config(cfg, PromptEncoder(TOK, cfg.data.chat_template), build_reward_fn(cfg.reward))
    records = [PromptRecord(i, p["prompt"], p["answer"], {}) for i, p in enumerate(problems(seed=3)[:12])]
    callers = [int(r.prompt.split("*")[0]) % 2 == 0 for r in records]
    assert 0 < sum(callers) < len(records)  # the premise: both kinds of episode
    client = ScriptedClient(TOK, even_caller, weight_version=None)
    service = ServingService(client)

    out = greedy_episodes(runner, service, records, version=7)

    assert (service.entered, service.left) == (1, 1)  # one serving phase, closed
    expected = sum(callers) / len(records)
    assert out["accuracy"] == expected
    assert out["multi_turn/tool_success_frac"] == expected and out["multi_turn/tool_use_frac"] == expected
    assert out["multi_turn/turns_mean"] == 1 + expected  # a tool call and an answer, or the answer alone
    assert all(r.sampling.temperature == 0.0 and r.sampling.samples_per_prompt == 1 for r, _ in client.requests)
    assert sorted(r.request_id for r, _ in client.requests) == sorted(
        [f"eval/{i}/0/t0" for i in range(len(records))] + [f"eval/{i}/0/t1" for i, c in enumerate(callers) if c])


def test_an_out_dir_holding_an_sft_model_is_refused_before_anything_starts(tmp_path):
    """OUT/sft_model (written after the SFT stage) marks an earlier run, finished or not: refused at once, not after
    minutes of SFT when the export would find it."""
    from megarl.config import ConfigError
    from megarl.trainer.tool_quickstart import ToolQuickstartSettings, run_tool_quickstart

    (tmp_path / "sft_model").mkdir()
    with pytest.raises(ConfigError, match=r"holds an earlier quickstart run"):
        run_tool_quickstart(ToolQuickstartSettings(out=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sft_model"]  # nothing written
