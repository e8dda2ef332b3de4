"""Multi-turn episodes with real engines (`tests/e2e/multi_turn_runs.py`: 7 worker processes, vLLM TP1 engines on a
rollout pool, two distillation teachers on pools of their own (Megatron, vLLM), an LLM judge on its pool, the tool
task's random model with a
byte-level BPE tokenizer and ChatML template, the echo environment from a user file). One session of ~40 s start-up
(its five worker groups, side by side), then 18 steps and 13 with a distillation teacher (~80 s in all, the
async run with its slowed engines the longest: runs.json's seconds); it cannot share the quickstart pool session (that
tokenizer has no chat template to render observations with).

Every trajectory of every step is verified against the engine's tokens inside the run (`verify_trajectory`, on by
default: the run would stop otherwise), so a passing run is itself the token-exactness check with real engines.
What the tests add, each from the engines' own numbers:
- every episode took its 3 turns (the observations were rendered and fed back), or was cut by the limits, counted;
- on the BPE vocabulary, sampled at temperature 1 with the defaults (on_template_mismatch: error), 5 sync steps ran
  with no episode masked, while turns that are not the canonical encoding of their text, and turns holding ids
  beyond the tokenizer, were sampled and counted (issue 29: such turns used to stop the run at step 1);
- one_step_off (3 steps): episodes of the next batch produced beside training take their turns, each batch from
  step 2 on sampled by the weights one version behind;
- in async mode with rollout.partial=continue, weights were pushed inside episodes: one batch holds turns sampled by
  two versions, and for each version's tokens the engine's log-probs against Megatron's recomputation with the
  weights being updated: float noise for the current version's, a real KL for the older one's -- so each turn's
  log-probs are those of the engine that sampled it.

On-policy distillation through the real loop (issue 33; the same session, its teachers "init" (colocated with the
actor) and "pooled" (on a pool of its own) = the student's starting weights, runs described in multi_turn_runs.py),
from each step's recorded batch:
- teacher = policy (step 1 from step 0): the reverse KL and every advantage are 0 within float error, while the
  teacher's log-probs of the sampled tokens are real (< 0);
- with the top-k forward KL (distillation.top_k=4, distill_sync's first step): the teacher's top-4 in the trained
  batch and the actor's term equal transformers' dense computation from the teacher's and the step-5 student's weights;
- in sync, one_step_off and async (multi-turn), and single-turn async, from a student 5 GRPO steps away: the
  teacher's log-probs of the batch's loss-mask tokens equal transformers' log-softmax of the teacher's HF model on the
  batch's own token ids (so they are of the tokens the update trains on, row for row), `distill/reverse_kl/init`
  equals the mean of (old log-prob - that) over the loss mask and is > 0, the advantages are teacher - old on the loss
  mask, and the tokens off the loss mask (the prompt, padding, and the observation tokens inside an episode, which
  the multi-turn runs have) get neither a teacher log-prob nor an advantage; the single-turn run is scored by
  "pooled", and each rank's count of the teacher calls it served shows "pooled" ran on its pool's worker only and
  "init" on the actor's.

- the vLLM-served teacher ("engine") in sync single-turn and async multi-turn runs: the same checks, and one
  prompt log-probs request per row with sampled tokens.
The LLM judge (issue 33 item 3), on the same session: 2 async single-turn steps, each trained reward equal to the
judge model's own transformers computation of its yes/no score, its judge/ metrics logged each step.
Agents (issue 32), on the same session:
- an agent written against the openai client (`rollout.env: agent:...`, two sampled answers through the endpoint)
  under one_step_off (3 steps) and async (max_staleness 1, rollout.partial=continue, 2 steps): its tokens' versions
  are those the mode promises (async: where a push lands inside episodes, each token keeps its engine's version), its
  `agent/` metrics are logged, no episode errs or times out, and a step's sample count (one per segment) is not
  fixed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import ROOT, read_rows

DISTILL_RUNS = ("distill_sync", "distill_one_step_off", "distill_async", "distill_single_turn_async",
                "distill_engine_sync", "distill_engine_async")
ENGINE_RUNS = ("distill_engine_sync", "distill_engine_async")  # scored by the vLLM-served teacher
# the teacher each distillation run enables ("pooled": on a pool of its own; "engine": served by a vLLM engine on its
# pool) and the steps it trains
DISTILL_TEACHER = {"distill_self": "init", "distill_sync": "init", "distill_one_step_off": "init",
                   "distill_async": "init", "distill_single_turn_async": "pooled",
                   "distill_engine_sync": "engine", "distill_engine_async": "engine"}
STEPS = {"distill_self": 1, "distill_sync": 2, "distill_one_step_off": 2, "distill_async": 2,
         "distill_single_turn_async": 2, "distill_engine_sync": 2, "distill_engine_async": 2}
SINGLE_TURN = ("distill_single_turn_async", "distill_engine_sync")
# fp32 Megatron TP2 vs transformers on this model: the log-prob error is float summation order (~1e-6, measured in
# tests/distributed/test_teacher.py); a misaligned or wrong-row teacher log-prob is off by > 0.1
TEACHER_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, joined_ray_env):
    out = tmp_path_factory.mktemp("multi_turn")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "e2e", "multi_turn_runs.py"), str(out)],
                          cwd=ROOT, env=joined_ray_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    print("multi-turn runs (s):", json.load(open(out / "runs.json")))
    names = ("sync", "async", "one_step_off", "distill_self", *DISTILL_RUNS, "judge_async")
    return {**{name: read_rows(out / name) for name in names}, "_out": out}


@pytest.fixture(scope="module")
def runs_dir(runs):
    return runs["_out"]


def test_the_sessions_weights_export_as_a_model_transformers_loads(runs_dir):
    """`TrainingSession.export_hf` (the tool quickstart's OUT/sft_model): a directory transformers loads, model and
    tokenizer, holding the weights the workers trained to -- those of the last run's final checkpoint, not the
    random start model's -- with no temporary directory or checkpoint left beside it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def weights(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()

    exported, checkpoint = weights(runs_dir / "session_hf"), weights(runs_dir / "checkpoint_hf")
    start = weights(runs_dir / "data" / "init_model")
    assert sorted(exported) == sorted(start)
    assert all(torch.equal(exported[k], checkpoint[k]) for k in exported)
    assert any(not torch.equal(exported[k], start[k]) for k in exported)  # trained, not the start model
    text = "<|im_start|>user\n12*34=<|im_end|>\n"
    assert (AutoTokenizer.from_pretrained(runs_dir / "session_hf")(text)["input_ids"]
            == AutoTokenizer.from_pretrained(runs_dir / "data" / "init_model")(text)["input_ids"])
    assert not [n for n in os.listdir(runs_dir) if n.startswith(".session_hf")]


def _distill_batches(runs, run: str) -> list[dict]:
    """The run's recorded batches (multi_turn_runs.record_distill_batches), step order."""
    import torch

    folder = runs["_out"] / run / "distill_batches"
    return [torch.load(folder / f"step_{i + 1}.pt") for i in range(len(os.listdir(folder)))]


def _transformers_log_probs(model_dir, input_ids, attention_mask):
    """[B, S] float32: log pi(input_ids[:, t] | input_ids[:, :t]) of the HF model at `model_dir` (transformers, fp32),
    position 0 = 0."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(lp.shape[0], 1), lp], dim=1)


@pytest.mark.parametrize("run", ["sync", "async", "one_step_off"])
def test_episodes_take_their_turns(runs, run):
    for row in runs[run]:
        # 3 turns unless the budget (32 generated tokens, 8 per turn) or a masked retokenization ended one early
        ended_early = row["multi_turn/truncated_frac"] + row["multi_turn/template_mismatch"] / row["samples"]
        assert row["multi_turn/turns_mean"] >= 3 * (1 - ended_early) - 1e-9, row
        assert row["multi_turn/turns_mean"] > 1.5
        assert row["response_length/mean"] > 8  # tokens sampled over several turns, more than one turn's limit
        # the random model rarely ends a turn itself: turns cut at 8 tokens are closed by the end-of-turn token
        assert row["multi_turn/turns_cut"] > 0
        assert row["multi_turn/template_mismatch"] == 0  # no episode masked: the defaults would have stopped the run
        # the observation tokens are inserted on the controller: an episode is no one completion of the engines, so
        # nothing is by reference to the rollout's packages; its rows cross once instead (each piece's ids, log-probs
        # and loss masks one object, put once, `TokenRowSource.from_rows`), the ranks rebuilding their shares'
        # four token keys from it: 1 token-sized crossing down (4 when they went by value), plus, in a batch mixing
        # weights versions (the asynchronous runs), policy_version by value
        assert row["dispatch/batch_pieces_by_reference"] == 0
        assert row["dispatch/token_rows_packed_pieces"] > 0
        if run == "sync":  # generation's ids and log-probs up, the episode rows down
            assert row["dispatch/token_tensors_down"] == 1, row
            assert row["dispatch/token_crossings"] == 3 + row["dispatch/token_results_up"], row
        else:
            assert row["dispatch/token_tensors_down"] in (1, 2), row


def test_bpe_turns_that_do_not_re_encode_to_themselves_are_trained_as_sampled(runs):
    rows = runs["sync"]
    assert [r["step"] for r in rows] == list(range(1, 6))  # 5 steps, none stopped by a sampled turn
    noncanonical = sum(r["multi_turn/noncanonical_turns"] for r in rows)
    undecodable = sum(r["multi_turn/undecodable_turns"] for r in rows)
    turns = sum(r["multi_turn/turns_mean"] * r["samples"] for r in rows)
    print(f"sync, 5 steps: {turns:.0f} sampled turns, {noncanonical:.0f} non-canonical, {undecodable:.0f} holding "
          "an id beyond the tokenizer, 0 masked")
    # what a random model over a 400-id BPE vocabulary samples: both cases, often (the premise of this test)
    assert noncanonical > 0.1 * turns and undecodable > 0
    assert all(r["multi_turn/template_mismatch"] == 0 for r in rows)


def test_async_pushes_land_between_turns_and_each_turn_keeps_its_engines_log_probs(runs):
    rows = runs["async"]
    mixed = [r for r in rows if "mismatch/lag0/kl" in r and "mismatch/lag1/kl" in r]
    assert mixed, [{k: v for k, v in r.items() if "lag" in k} for r in rows]
    for r in mixed:
        assert r["async/staleness_max"] <= 1
        assert r["mismatch/lag0/kl"] < r["mismatch/lag1/kl"] / 10, r
    print("lag0 vs lag1 KL:", [(r["mismatch/lag0/kl"], r["mismatch/lag1/kl"]) for r in mixed])


def test_one_step_off_episodes_train_on_the_batch_generated_one_version_behind(runs):
    rows = runs["one_step_off"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # step 1 waits for its own batch (version 0); batch k >= 2 was generated while step k - 1 trained, on version
    # k - 2: every episode's oldest token one version behind the weights being updated
    assert [(r["async/version"], r["async/staleness_max"], r["async/staleness_mean"]) for r in rows] == \
        [(0.0, 0.0, 0.0), (0.0, 1.0, 1.0), (1.0, 1.0, 1.0)]


def test_teacher_equal_to_the_policy_gives_zero_reverse_kl_and_zero_advantages(runs):
    [row] = runs["distill_self"]
    [batch] = _distill_batches(runs, "distill_self")
    mask = batch["loss_mask"].bool()
    teacher = batch["teacher_log_probs"]["init"]
    assert float(teacher[mask].mean()) < -0.5  # real log-probs of sampled tokens, not an empty answer
    assert abs(row["distill/reverse_kl/init"]) < 1e-5, row["distill/reverse_kl/init"]
    assert float((teacher - batch["old_log_probs"])[mask].abs().max()) < TEACHER_ATOL
    # task_reward_coef 0: nothing but the distillation advantage, which is 0 when the teacher is the policy
    assert float(batch["advantages"].abs().max()) < TEACHER_ATOL


@pytest.mark.parametrize("run", DISTILL_RUNS)
def test_teacher_scores_the_trained_tokens_in_every_mode(runs, run):
    import torch

    rows, batches = runs[run], _distill_batches(runs, run)
    assert len(batches) == len(rows) >= 2
    model_dir = json.load(open(runs["_out"] / "runs.json"))["_teacher"]
    name = DISTILL_TEACHER[run]
    for row, batch in zip(rows, batches):
        mask = batch["loss_mask"].bool()
        assert sorted(batch["teacher_log_probs"]) == [name]
        teacher, old, adv = batch["teacher_log_probs"][name], batch["old_log_probs"], batch["advantages"]
        expected = _transformers_log_probs(model_dir, batch["input_ids"], batch["attention_mask"])
        assert float((teacher - expected)[mask].abs().max()) < TEACHER_ATOL, run
        reverse_kl = float((old - expected)[mask].mean())
        assert row[f"distill/reverse_kl/{name}"] == pytest.approx(reverse_kl, abs=TEACHER_ATOL)
        assert reverse_kl > 0.01  # a student 5 steps away from its starting weights (measured: >= 0.023)
        assert torch.allclose(adv[mask], (expected - old)[mask], atol=TEACHER_ATOL)
        # observation tokens: inside the episode (after its first sampled token), not sampled by the student
        first = mask.float().argmax(dim=1, keepdim=True)
        inside = (torch.arange(mask.shape[1])[None] > first) & batch["attention_mask"].bool()
        observation = inside & ~mask
        if run in SINGLE_TURN:
            assert int(observation.sum()) == 0  # one response per row: every token after its first one is sampled
        else:
            assert int(observation.sum()) > 0  # the echo environment's messages between turns
        # off the loss mask (prompt, observations, padding) the teacher scores nothing and nothing is trained
        assert float(teacher[~mask].abs().sum()) == 0.0
        assert float(adv[~mask].abs().sum()) == 0.0
    if run not in ("distill_sync", "distill_engine_sync"):  # the modes that train on a batch sampled one version behind
        assert max(r["async/staleness_max"] for r in rows) == 1.0


def test_each_teacher_ran_on_its_own_pools_workers(runs_dir):
    """The teacher on a pool of its own ("pooled", pool "teach") was served by that pool's worker, once per step of
    the one run it scores, and never by the actor's pool; the colocated one ("init") by every actor-pool rank, once
    per step of its runs, and never on "teach" (each rank's own count of the calls it served)."""
    calls = json.load(open(runs_dir / "runs.json"))["_teacher_calls"]
    actor_pool, teacher_pool = calls["actor_pool"], calls["teacher_pool"]
    steps = {"init": sum(STEPS[r] for r, t in DISTILL_TEACHER.items() if t == "init"),
             "pooled": sum(STEPS[r] for r, t in DISTILL_TEACHER.items() if t == "pooled")}
    assert steps == {"init": 7, "pooled": 2}
    assert [(r["pool"], r["calls"]) for r in actor_pool] == [("train", {"init": steps["init"]})] * 2
    assert [(r["pool"], r["calls"]) for r in teacher_pool] == [("teach", {"pooled": steps["pooled"]})]
    assert not {r["pid"] for r in teacher_pool} & {r["pid"] for r in actor_pool}


def test_the_vllm_teacher_was_asked_once_per_sampled_row(runs):
    """The vLLM-served teacher ("engine", backend vllm) got one prompt log-probs request per row with sampled tokens
    of the batches of the two runs it scores (single-turn sync, multi-turn async; counted by the controller's
    `EngineTeacher`), and no Megatron rank served it."""
    import torch

    calls = json.load(open(runs["_out"] / "runs.json"))["_teacher_calls"]
    rows = sum(int(b["loss_mask"].bool().any(dim=1).sum()) for run in ENGINE_RUNS for b in _distill_batches(runs, run))
    assert rows >= 2 * 2 * 64 - 4 and calls["engine_requests"] == rows
    assert all("engine" not in r["calls"] for r in calls["actor_pool"] + calls["teacher_pool"])
    assert torch.is_tensor(_distill_batches(runs, "distill_engine_sync")[0]["teacher_log_probs"]["engine"])


def test_the_top_k_forward_kl_runs_through_the_loop(runs):
    """distill_sync's first step (sync, from the student 5 GRPO steps away, distillation.top_k=4): the batch the
    update trained on carries the teacher's top-4 at every loss-mask token, equal to transformers' top-4 of the
    teacher's HF model on the batch's own ids (0 elsewhere: prompt, observations, padding), and the actor's
    `actor/distill_top_k_kl` equals the term computed densely by transformers from the step-5 student's weights
    (exported from its checkpoint) on those ids: it went down to the update through the real dispatch."""
    import torch
    from transformers import AutoModelForCausalLM

    row, batch = runs["distill_sync"][0], _distill_batches(runs, "distill_sync")[0]
    model_dir = json.load(open(runs["_out"] / "runs.json"))["_teacher"]
    mask = batch["loss_mask"].bool()
    ids, top = batch["teacher_top_k_ids"], batch["teacher_top_k_log_probs"]
    assert ids.shape == (*mask.shape, 4) and ids.dtype == torch.int64

    def log_softmax(path):
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        return torch.nn.functional.pad(torch.log_softmax(logits[:, :-1], -1), (0, 0, 1, 0))  # token-aligned

    want_top, want_ids = log_softmax(model_dir).topk(4, -1)
    assert torch.equal(ids[mask], want_ids[mask])
    assert float((top - want_top)[mask].abs().max()) < TEACHER_ATOL
    assert float(ids[~mask].abs().sum()) == 0 and float(top[~mask].abs().sum()) == 0.0
    student = log_softmax(runs["_out"] / "student_hf").gather(-1, ids)
    dense = float(((want_top.exp() * (want_top - student)).sum(-1))[mask].mean())
    assert dense > 1e-3  # the student is 5 steps away from the teacher (measured: 0.0080; 0.0097 after 20 steps)
    assert row["actor/distill_top_k_kl"] == pytest.approx(dense, abs=TEACHER_ATOL)


# ---------------------------------------------------------------------------------------------------- judge
# The session's judge (reward.judge on pool "judge": the tool task's model served by a vLLM engine, P(Yes)/(P(Yes)+
# P(No)) of its next token), enabled by one run only: judge_async (single-turn, async, max_staleness 1, 2 steps).
# Measured on this model: the engine's two-way probability differs from transformers' fp32 one by < 1e-5 (float
# error of the prompt log-probs); a score of another response or prompt differs by > 1e-2.
JUDGE_ATOL = 1e-4


def test_judge_scores_are_the_rewards_trained_on_in_async_mode(runs):
    """judge_async: every reward of each step's trained batch (recorded as the step took it) equals the judge
    model's own transformers computation -- the softmax over the first tokens of "Yes" and "No" of its fp32 logits
    after the run's template, filled in with the sample's question, decoded response and reference answer and
    rendered by the judge tokenizer's chat template -- and the judge/ metrics are logged every step (every response
    judged or answered from the cache, none failed or unparseable)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = runs["judge_async"]
    assert [r["step"] for r in rows] == [1, 2]
    judge = json.load(open(runs["_out"] / "runs.json"))["_judge"]
    tokenizer = AutoTokenizer.from_pretrained(judge["model"])
    model = AutoModelForCausalLM.from_pretrained(judge["model"], dtype=torch.float32).eval()
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No"))
    for row in rows:
        batch = json.load(open(runs["_out"] / "judge_async" / "judged_batches" / f"step_{row['step']}.json"))
        assert len(batch) == row["samples"] == 64
        expected = []
        for sample in batch:
            response = tokenizer.decode(sample["response_ids"], skip_special_tokens=True).strip()
            message = judge["template"].format(question=sample["prompt"], response=response,
                                               reference=sample["answer"])
            text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
            with torch.no_grad():
                last = model(ids).logits[0, -1].double()
            expected.append(float(torch.softmax(last[[yes, no]], dim=0)[0]))
        got = [sample["reward"] for sample in batch]
        assert max(abs(g - e) for g, e in zip(got, expected)) < JUDGE_ATOL, row["step"]
        assert max(expected) - min(expected) > 1e-3  # the scores differ between samples: not one constant
        assert row["reward/mean"] == pytest.approx(sum(expected) / len(expected), abs=JUDGE_ATOL)
        # two requests per judged response (the Yes and No candidates), the rest answered by the cache
        assert row["judge/requests"] / 2 + row["judge/cache_hits"] == 64, row
        assert row["judge/errors"] == 0 and row["judge/parse_failures"] == 0, row
        assert row["judge/score_mean"] == pytest.approx(row["reward/mean"], abs=JUDGE_ATOL)
        assert row["async/staleness_max"] <= 1


def test_runs_without_reward_judge_do_not_use_the_sessions_judge(runs):
    """The session started the judge (its config has reward.judge); the runs whose own config has none
    (`train_from` with the driver's raw config) are scored by their own rewards: no judge/ metric in their rows."""
    for run in ("sync", "async", "distill_single_turn_async", "distill_engine_sync"):
        assert all(not any(k.startswith("judge/") for k in r) for r in runs[run]), run
    assert all("judge/requests" in r for r in runs["judge_async"])


# ---------------------------------------------------------------------------------------------------- agents
# An agent against the openai client (tests/unit/fixtures/agents/calculator_agents.py:two_sampled_turns: two answers
# of 8 sampled tokens, the history re-rendered from their text) through the endpoint, under the off-policy modes.
AGENT_RUNS = ("agent_one_step_off", "agent_async")
EPISODES = 8 * 8  # data.prompts_per_step x rollout.samples_per_prompt


@pytest.fixture(scope="module")
def agent_runs(runs_dir):
    return {name: read_rows(runs_dir / name) for name in AGENT_RUNS}


def _lags(row) -> dict[int, float]:
    """weights versions behind the updated ones -> fraction of the batch's sampled tokens (from their versions)"""
    return {int(k.rsplit("/", 1)[1]): v for k, v in row.items() if k.startswith("async/lag_frac/")}


@pytest.mark.parametrize("run", AGENT_RUNS)
def test_agent_episodes_log_their_metrics_and_train_every_segment(agent_runs, run):
    rows = agent_runs[run]
    for row in rows:
        assert row["agent/errors"] == 0 and row["agent/timeouts"] == 0, row  # none hung past agent_timeout_s
        assert row["agent/requests_per_episode"] == 2  # both of the agent's requests were answered
        # the re-rendered history of a random BPE model's answer rarely re-encodes to the sampled ids: new segments
        assert 1 <= row["agent/segments_per_episode"] <= 2
        # one trajectory per segment holding a sampled token: the step's samples are not prompts x samples_per_prompt
        assert EPISODES <= row["samples"] <= row["agent/segments_per_episode"] * EPISODES + 1e-9, row
        assert 0 < row["agent/answer_chars"]  # the agent's own info, averaged over its episodes
    assert any(row["samples"] > EPISODES for row in rows)


def test_agent_one_step_off_trains_each_batch_on_tokens_one_version_behind(agent_runs):
    rows = agent_runs["agent_one_step_off"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # as the echo environment's episodes: step 1 waits for its own batch (version 0); batch k >= 2 was sampled while
    # step k - 1 trained, on version k - 2 -- every sampled token of the batch, both of each episode's requests
    assert [(r["async/version"], r["async/staleness_max"], r["async/staleness_mean"], _lags(r)) for r in rows] == \
        [(0.0, 0.0, 0.0, {0: 1.0}), (0.0, 1.0, 1.0, {1: 1.0}), (1.0, 1.0, 1.0, {1: 1.0})]


def test_agent_async_keeps_token_versions_within_the_staleness_bound(agent_runs):
    rows = agent_runs["agent_async"]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        lags = _lags(row)
        assert abs(sum(lags.values()) - 1) < 1e-9 and max(lags) <= 1 and row["async/staleness_max"] <= 1, row
        assert row["async/version"] == row["step"] - 1 - max(lags)  # the batch's version is its oldest token's
    # rollout.partial=continue: a push may land while the agents' requests are in the engines; whether it does
    # depends on this machine's load (the endpoint and 64 agents start per batch: when that takes longer than a
    # training step, every batch is sampled on the newest weights), so no count of them is asserted. Where a batch
    # mixes versions, each token carries the version of the engine that sampled it: against Megatron's
    # recomputation with the weights being updated, the current version's tokens agree to float noise, the older
    # version's differ by a real KL
    mixed = [r for r in rows if "mismatch/lag0/kl" in r and "mismatch/lag1/kl" in r]
    for r in mixed:
        assert 0 < r["async/lag_frac/0"] < 1 and r["mismatch/lag0/kl"] < r["mismatch/lag1/kl"] / 10, r
    print(f"agent async: {len(mixed)} of {len(rows)} batches mixed two versions; lag0 vs lag1 KL:",
          [(r["mismatch/lag0/kl"], r["mismatch/lag1/kl"]) for r in mixed])
