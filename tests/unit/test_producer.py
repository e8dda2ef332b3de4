"""`BatchProducer` (`megarl.trainer.producer`): groups scored as their requests finish, over-sampling with abort.

The client is scripted (a `RolloutClient` whose requests finish in an order the test fixes with events); the real
engines behind the router run in tests/e2e (the golden quickstart curve, sync, and the rollout-pool runs, one_step_off
and async). Order, not time: the client and the reward function append to one event log, and the assertions read
that order. Every wait of the client is bounded (WAIT_S); on broken code a wait runs out and the test fails on the
order or on the timeout, never on a duration.
"""

from __future__ import annotations

import asyncio
import json
import threading
import types

import pytest
import torch

from megarl.config.schema import RewardConfig
from megarl.data.dataset import PromptDataset, PromptLoader
from megarl.rollout.client import RolloutTimeout
from megarl.rollout.engine import Completion, GenerationOutput, SamplingSettings
from megarl.trainer.producer import BatchProducer

WAIT_S = 10.0  # bound on each wait of the scripted client (never reached when the producer works)


class Encoder:
    def encode(self, prompt: str) -> list[int]:
        return [int(prompt)]

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


def cfg(prompts_per_step: int, oversample: int = 0):
    return types.SimpleNamespace(
        rollout=types.SimpleNamespace(oversample=oversample, samples_per_prompt=2, max_prompt_tokens=8,
                                      overlong_prompt="error", max_new_tokens=8),
        data=types.SimpleNamespace(prompts_per_step=prompts_per_step),
        algorithm=types.SimpleNamespace(dynamic_sampling=types.SimpleNamespace(enabled=False)),
        reward=RewardConfig())


def loader(tmp_path, n: int, prompts_per_step: int) -> PromptLoader:
    """The real loader over n records: prompt str(10 * i), answer str(i), in file order."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": str(10 * i), "answer": str(i)}) + "\n" for i in range(n)))
    return PromptLoader(PromptDataset(str(path)), prompts_per_step, shuffle=False)


class OrderedClient:
    """Prompt p's request answers samples_per_prompt completions [p, j] (j = sample index) once `gates[p]` (a
    threading.Event, or None: at once) is set, logging ("finished", p); a request in `hang` waits until aborted
    (then raises CancelledError, as the router's callers do) or WAIT_S (RolloutTimeout). Logs ("aborted", ids)."""

    replicas = 1
    weight_version = 5

    def __init__(self, log: list, gates=None, hang=()) -> None:
        self.log, self.gates, self.hang = log, dict(gates or {}), set(hang)
        self.aborted: set[str] = set()
        self.requests: list[str] = []

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        p = request.prompt_ids[0] // 10
        self.requests.append(request.request_id)
        gate = self.gates.get(p)
        if p in self.hang:
            for _ in range(int(WAIT_S / 0.01)):
                if request.request_id in self.aborted:
                    raise asyncio.CancelledError
                await asyncio.sleep(0.01)
            raise RolloutTimeout(f"request {request.request_id!r} was never aborted")
        if gate is not None and not await asyncio.to_thread(gate.wait, WAIT_S):
            self.log.append(("gate timed out", p))
        self.log.append(("finished", p))
        completions = [Completion(j, [p, j], [-0.5, -0.5], "stop") for j in range(request.sampling.samples_per_prompt)]
        return GenerationOutput(request.request_id, list(request.prompt_ids), completions, True)

    async def abort(self, request_ids):
        self.log.append(("aborted", sorted(request_ids)))
        self.aborted.update(request_ids)
        return len(request_ids)

    def metrics(self):
        return {}


def test_each_group_is_scored_before_the_batchs_last_group_finishes_with_the_whole_batchs_scores(tmp_path):
    """3 groups; group 2's request finishes only once the reward function has scored group 0 (its gate is set by
    the reward call). The log must show group 0 scored before group 2 finished, and the scores equal, in order,
    what scoring the whole batch afterwards gives (`BatchProducer.scores`)."""
    log: list = []
    scored_group0 = threading.Event()

    def reward(text, answer, record):
        p = int(text.split()[0])
        log.append(("scored", p))
        if p == 0:
            scored_group0.set()
        return float(p) + 0.25 * int(text.split()[1])  # differs per sample: a reordering shows

    producer = BatchProducer(cfg(3), loader(tmp_path, 3, 3), Encoder(), reward,
                             sampling=SamplingSettings(samples_per_prompt=2, max_new_tokens=8, seed=0))
    client = OrderedClient(log, gates={1: scored_group0, 2: scored_group0})
    timers: dict = {}
    batch = producer.produce(4, client, 3, timers)
    assert ("gate timed out", 2) not in log, log
    assert log.index(("scored", 0)) < log.index(("finished", 2)), log
    assert [(s.prompt_index, s.response_ids) for s in batch.samples] == [(p, [p, j]) for p in range(3) for j in (0, 1)]
    whole, _ = producer.scores(batch.samples, batch.records, "the whole batch")
    assert torch.equal(batch.scores, whole)
    assert batch.scores.tolist() == [0.0, 0.25, 1.0, 1.25, 2.0, 2.25]
    assert batch.version == 3 and batch.token_versions is None
    assert batch.metrics["time/reward_overlap_s"] > 0.0 and timers["reward_overlap"] > 0.0
    assert "rollout/oversampled_aborted_groups" not in batch.metrics  # off by default


def test_oversampling_keeps_the_first_groups_to_finish_in_prompt_order_and_aborts_the_rest(tmp_path):
    """prompts_per_step=3, oversample=2: 5 prompts drawn; prompts 1 and 3 never finish unless aborted; the others
    finish in the order 4, 2, 0. The batch holds prompts 0, 2, 4 in prompt order (renumbered 0..2), the two others'
    requests are aborted and counted, and the loader has moved past all 5 (the next batch starts at record 5)."""
    log: list = []
    done = {p: threading.Event() for p in (2, 4)}

    def reward(text, answer, record):
        p = int(text.split()[0])
        if p in done:
            done[p].set()
        return float(p)

    data = loader(tmp_path, 12, 3)
    producer = BatchProducer(cfg(3, oversample=2), data, Encoder(), reward,
                             sampling=SamplingSettings(samples_per_prompt=2, max_new_tokens=8, seed=0))
    client = OrderedClient(log, gates={2: done[4], 0: done[2]}, hang=(1, 3))
    batch = producer.produce(7, client, 3)
    assert [x for x in log if x[0] == "finished"] == [("finished", 4), ("finished", 2), ("finished", 0)], log
    assert log[-1] == ("aborted", ["7/0/1/t0", "7/0/3/t0"]), log
    assert [r.answer for r in batch.records] == ["0", "2", "4"]
    assert [(s.prompt_index, s.response_ids[0]) for s in batch.samples] == [(0, 0), (0, 0), (1, 2), (1, 2), (2, 4),
                                                                            (2, 4)]
    assert batch.scores.tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0]
    assert batch.metrics["rollout/oversampled_aborted_groups"] == 2.0
    assert data.state_dict()["position"] == 5
    assert [r.answer for r in data.next_batch()] == ["5", "6", "7"]


def test_oversampling_with_rollout_env_is_refused_by_key():
    from megarl.config import ConfigError, load_config
    from tests.unit.test_config_yaml import REPO

    with pytest.raises(ConfigError, match="rollout.oversample=2 with rollout.env: over-sampling is single-turn only"):
        load_config(REPO / "yaml_configs" / "cpu_quickstart.yaml",
                    ["rollout.env=calculator", "data.chat_template=hf", "rollout.oversample=2"])
