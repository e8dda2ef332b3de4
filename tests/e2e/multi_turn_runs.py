"""Driver of `tests/e2e/test_multi_turn.py`: multi-turn episodes with real engines, in one session of 4 worker
processes (actor TP2 on pool "train", two vLLM TP1 engines on pool "rollout"): the tool task's random model with a
real byte-level BPE vocabulary and ChatML template (`megarl.data.tool_task`, tokenizer "bpe": 400 ids trained with
`tokenizers`, 16 embedding rows past them), sampled at temperature 1 with the config's defaults, and the echo
environment (`tests/e2e/echo_env.py`: every episode takes 3 turns whatever is sampled). A random model samples
merged and unmerged spellings alike, so most turns are not the canonical encoding of their text, and some hold ids
the tokenizer cannot decode: what a real BPE model does, which must not stop or mask an episode.

Runs (each from the session's step-0 checkpoint): "sync" (SYNC_STEPS = 5 steps), "async" (trainer.mode=async,
max_staleness 1, rollout.partial=continue: weight pushes land inside episodes, mid-turn or between turns; 3 steps:
every batch from step 2 on holds two versions here, step 3 is the second chance on a slower host) and "one_step_off"
(3 steps: the next batch's episodes produced on the background thread while the step trains). The async run's
engine servers sleep STEP_DELAY_S after each decode step (`SlowEngine`): the tiny model samples a batch's turns
faster than the trainer trains, and pushes land inside an episode only when generating takes longer than a training
step, as it does with real models.

On-policy distillation runs (issue 33) share the session: it holds three teachers, all the student's own starting
weights (the tool task's model directory): "init", colocated with the actor (TP2), "pooled", on a pool of its own
("teach", 1 device, TP1, a `TeacherWorker` group), and "engine" (backend vllm: a vLLM engine on pool "teach_vllm");
each distillation run enables one, the other runs none. "distill_self" (sync, 1 step
from step 0: the teacher equals the policy) and, from the sync run's last checkpoint (a student SYNC_STEPS GRPO steps
away from the teacher: reverse KL >= 0.023, top-k forward KL 0.008 measured at 5 steps, where the tests need > 0.01 and
> 0.001), "distill_sync" (2 steps, distillation.top_k=4: the top-k forward KL term in the actor's loss too, the
weights of its starting checkpoint exported to OUT_DIR/student_hf for the test's dense computation of its first
step's term), "distill_one_step_off" (2), "distill_async" (2, max_staleness 1) and
"distill_single_turn_async" (2, rollout.env=null: single-turn samples of the same prompts; the only one scored by
"pooled"), "distill_engine_sync" (2, sync, single-turn, scored by "engine") and "distill_engine_async" (2, async,
max_staleness 1, multi-turn, scored by "engine"; the last run), all with
distillation.task_reward_coef 0 (the advantage is the distillation one alone). 2 steps each: step 1 trains on a
batch of the starting weights, step 2 (in the off-policy modes) on one a version behind. Each step's batch after the
distillation advantage is recorded (`record_distill_batches`: `<run>/distill_batches/step_N.pt`) for the test to
recompute from.

The session also holds an LLM judge (reward.judge on pool "judge": the tool task's model, yes_no_logprob through
JUDGE_TEMPLATE), which one run enables: "judge_async" (async, max_staleness 1, 2 steps from step 0, single-turn, no
teacher); each step's trained rollout batch is recorded as the step takes it (`record_judged_batches`:
`<run>/judged_batches/step_N.json`). runs.json's "_judge" holds the judge's config.

After the runs, the session's current weights are written as a HuggingFace directory (`TrainingSession.export_hf`,
what `megarl quickstart --task tools` writes its SFT model with) to OUT_DIR/session_hf, and the last run's final
checkpoint exported on its own (`megarl.checkpoint.export.export_hf`) to OUT_DIR/checkpoint_hf. runs.json's
"_teacher_calls" holds each rank's pool, pid and teacher calls served, of the actor's pool and of "teach", and the
requests the controller sent to "engine"; each run's "seconds", and "_phases" the seconds of the data, the session's
start, the step-0 checkpoint, its close and the exports (where a change to this file's runs would go).

    python tests/e2e/multi_turn_runs.py OUT_DIR     # OUT_DIR/<run>/metrics.jsonl, runs.json, the two HF dirs
"""

from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "yaml_configs", "cpu_tools_quickstart.yaml")
ECHO = os.path.join(ROOT, "tests", "e2e", "echo_env.py") + ":echo_env"
# 0.1 s: a batch's three turns of 8 tokens then take ~2x a training step here (the former per-call delay of 0.8 s x 3
# turns; 0.3 s per call made them equal, and whether a push landed inside a batch depended on the machine's load)
STEP_DELAY_S = 0.1
TIS = ["algorithm.rollout_correction.tis=token"]
TEACHERS = ("init", "pooled", "engine")


def only(teacher=None) -> list[str]:
    """Overrides that leave teacher `teacher` the only one enabled (None: none)."""
    return [f"distillation.teachers.{t}.enabled=false" for t in TEACHERS if t != teacher]


NO_TEACHER = only(None)
# name -> (overrides, steps trained, starting checkpoint: "step0" or (run, step): its steps then continue from there)
# 5 sync steps: the BPE check needs steps that sample turns (~190 per step, ~130 of them non-canonical, ~50 holding an
# undecodable id), the distillation runs a student measurably away from the teacher (see the module docstring)
SYNC_STEPS = 5
STUDENT = ("sync", SYNC_STEPS)  # the distillation runs start from the sync run's last checkpoint
RUNS = {"sync": (["trainer.mode=sync", *NO_TEACHER], SYNC_STEPS, "step0"),
        "async": (["trainer.mode=async", "trainer.max_staleness=1", "rollout.partial=continue", *TIS, *NO_TEACHER], 3,
                  "step0"),
        "one_step_off": (["trainer.mode=one_step_off", *TIS, *NO_TEACHER], 3, "step0"),
        "distill_self": (["trainer.mode=sync", *only("init")], 1, "step0"),
        # plus the top-k forward KL term (distillation.top_k=4) in the actor's loss (once a run of its own,
        # "distill_top_k": the reverse-KL advantage distill_sync is checked on does not depend on it)
        "distill_sync": (["trainer.mode=sync", "distillation.top_k=4", *only("init")], 2, STUDENT),
        "distill_one_step_off": (["trainer.mode=one_step_off", *TIS, *only("init")], 2, STUDENT),
        "distill_async": (["trainer.mode=async", "trainer.max_staleness=1", *TIS, *only("init")], 2, STUDENT),
        # single-turn (no environment: one response per prompt, exact-match reward) in async mode, scored by the
        # teacher on a pool of its own
        "distill_single_turn_async": (["trainer.mode=async", "trainer.max_staleness=1", *TIS, "rollout.env=null",
                                       *only("pooled")], 2, STUDENT),
        # single-turn, sync, scored by the vLLM-served teacher (backend vllm) on its pool
        "distill_engine_sync": (["trainer.mode=sync", "rollout.env=null", *only("engine")], 2, STUDENT),
        # multi-turn episodes (observation tokens between the turns) in async mode, scored by the vLLM-served teacher:
        # its prompt log-probs requests are made from the training step while the rollout driver's thread generates
        "distill_engine_async": (["trainer.mode=async", "trainer.max_staleness=1", *TIS, *only("engine")], 2,
                                 STUDENT)}
# the LLM judge (reward.judge, on pool "judge"): the tool task's own model (its BPE tokenizer has a ChatML template),
# P(Yes)/(P(Yes)+P(No)) of its next token; the session starts it, and only the runs below enable it (the others set
# reward.judge=null, as their raw config has none)
JUDGE_TEMPLATE = ("Question: {question}\nResponse: {response}\nReference answer: {reference}\n"
                  "Is the response correct? Answer Yes or No.")
# single-turn (rollout.env=null: each group judged on the reward thread as it finishes, overlapping generation) in
# async mode, from step 0, no teacher: reward = the judge's score alone (function_weight 0)
JUDGE_RUNS = {"judge_async": (["trainer.mode=async", "trainer.max_staleness=1", *TIS, "rollout.env=null",
                               *NO_TEACHER], 2)}
DISTILL_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages", "old_log_probs", "rollout_log_probs",
                "policy_version", "teacher_top_k_ids", "teacher_top_k_log_probs")


def record_distill_batches() -> None:
    """Wrap `RLLoop._distill` (the step's distillation advantage) so that each step's batch right after it is saved:
    `<run dir>/distill_batches/step_N.pt` = {DISTILL_KEYS: [B, S] tensors, "teacher_log_probs": {name: [B, S]},
    "metrics": what it returned}; N counts the run's calls from 1. The loop itself is unchanged."""
    import torch

    from megarl.trainer.rl_trainer import RLLoop

    original = RLLoop._distill

    def recording(self, batch, teacher_log_probs, rollout, trajectories):
        metrics = original(self, batch, teacher_log_probs, rollout, trajectories)
        out = os.path.join(os.path.dirname(self.metrics_path), "distill_batches")
        os.makedirs(out, exist_ok=True)
        n = len(os.listdir(out)) + 1
        torch.save({**{k: batch.tensors[k].clone() for k in DISTILL_KEYS if k in batch.tensors},
                    "teacher_log_probs": {k: v.tensors["log_probs"].clone() for k, v in teacher_log_probs.items()},
                    "metrics": dict(metrics)}, os.path.join(out, f"step_{n}.pt"))
        return metrics

    RLLoop._distill = recording


def record_judged_batches() -> None:
    """Wrap `RLLoop.step` so that, in a run with a judge, the rollout batch each step trains on is saved as it is
    taken: `<run dir>/judged_batches/step_N.json` = [{"prompt", "answer", "response_ids", "reward"}] per sample (its
    record's prompt and answer, the sampled ids, the reward the step trains on). The loop itself is unchanged."""
    from megarl.trainer.rl_trainer import RLLoop

    original = RLLoop.step

    def recording(self, step):
        schedule = self.schedule
        if self.producer.judge is not None and not getattr(schedule.take, "recording", False):
            take = schedule.take

            def recorded_take(step, t):
                rollout = take(step, t)
                out = os.path.join(os.path.dirname(self.metrics_path), "judged_batches")
                os.makedirs(out, exist_ok=True)
                rows = [{"prompt": rollout.records[s.prompt_index].prompt,
                         "answer": rollout.records[s.prompt_index].answer, "response_ids": list(s.response_ids),
                         "reward": float(score)} for s, score in zip(rollout.samples, rollout.scores.tolist())]
                with open(os.path.join(out, f"step_{step}.json"), "w") as f:
                    json.dump(rows, f)
                return rollout

            recorded_take.recording = True
            schedule.take = recorded_take
        return original(self, step)

    RLLoop.step = recording
# an agent written against the openai client (two sampled answers, `two_sampled_turns`) through the endpoint, in the
# two off-policy modes (async: 2 steps, the second the first whose batch can lag; more steps repeat that case, as
# no count of pushes inside episodes is asserted, see the test). The session's actor.mini_batch_prompts is null (one
# optimizer step over a step's samples, as 8 prompts made it before): the workers' mini-batch size is fixed when they
# start, and an agent's segments make a step's sample count vary. agent_timeout_s 30: a run closed with a batch of
# agents in flight waits for them up to that long (their requests are not answered once the servers stop)
AGENT = os.path.join(ROOT, "tests", "unit", "fixtures", "agents", "calculator_agents.py") + ":two_sampled_turns"
AGENT_OPTIONS = [f"rollout.env=agent:{AGENT}", "rollout.env_options={}", "rollout.agent_timeout_s=30",
                 "algorithm.rollout_correction.tis=token", *NO_TEACHER]
AGENT_RUNS = {"agent_one_step_off": (["trainer.mode=one_step_off", *AGENT_OPTIONS], 3),
              "agent_async": (["trainer.mode=async", "trainer.max_staleness=1", "rollout.partial=continue",
                              *AGENT_OPTIONS], 2)}


class SlowEngine:
    """The rollout service with its engine servers slowed by STEP_DELAY_S per decode step (see the module
    docstring)."""

    def __init__(self, service) -> None:
        self.service = service

    def __getattr__(self, name):
        return getattr(self.service, name)

    def start_serving(self, **options):
        return self.service.start_serving(**options, step_delay_s=STEP_DELAY_S)


def main(out: str) -> None:
    began = time.monotonic()
    import yaml

    from megarl.config.loader import apply_overrides, parse_config
    from megarl.config.validate import validate
    from megarl.data.tool_task import build_tool_task
    from megarl.trainer import checkpointing
    from megarl.trainer.session import TrainingSession

    data = build_tool_task(os.path.join(out, "data"), n_val=16, tokenizer="bpe")
    raw = apply_overrides(yaml.safe_load(open(CONFIG)), [
        f"model.path={data['model']}", f"data.train_path={data['train']}", f"data.val_path={data['val']}",
        f"logging.dir={os.path.join(out, 'session')}", "logging.plots=false", "logging.progress=lines",
        "resources.pools={train: {nodes: 1, devices_per_node: 2}, rollout: {nodes: 1, devices_per_node: 2}, "
        "teach: {nodes: 1, devices_per_node: 1}, teach_vllm: {nodes: 1, devices_per_node: 1}, "
        "judge: {nodes: 1, devices_per_node: 1}}",
        "actor.pool=train", "rollout.pool=rollout", "trainer.val_every=0", "data.prompts_per_step=8",
        "actor.mini_batch_prompts=null", f"rollout.env={ECHO}", "rollout.env_options={turns: 3}", "rollout.max_turns=3",
        "rollout.max_tokens_per_turn=8", "rollout.max_new_tokens=32", "rollout.max_prompt_tokens=160"])
    # the teachers, all the student's starting weights: "init" colocated with the actor, TP2 as the actor, "pooled"
    # on a pool of its own ("teach", TP1), "engine" served by a vLLM engine on its pool ("teach_vllm"); each run
    # enables one at most (the session's workers hold them all)
    raw["distillation"] = {"teachers": {
        "init": {"path": data["model"], "parallel": {"tp": 2}, "micro_batch_samples": 32},
        "pooled": {"path": data["model"], "pool": "teach", "parallel": {"tp": 1}, "micro_batch_samples": 32,
                   "data_source": "pooled"},
        "engine": {"path": data["model"], "pool": "teach_vllm", "backend": "vllm", "parallel": {"tp": 1},
                   "data_source": "engine"}}, "task_reward_coef": 0.0}
    record_distill_batches()
    record_judged_batches()
    judge = {"model": data["model"], "pool": "judge", "template": JUDGE_TEMPLATE, "parse": "yes_no_logprob",
             "max_prompt_tokens": 200, "max_concurrent": 16}
    raw_judge = {**raw, "reward": {**raw.get("reward", {}), "judge": judge}}
    # the session's own config enables every teacher, which the runs' multi-turn episodes refuse (several teachers
    # route by data source): it is built without rollout.env, which its workers do not read (each run sets its own);
    # it has the judge, whose engines then serve the session (the runs without reward.judge do not use it)
    session = TrainingSession(validate(parse_config(raw_judge, ["trainer.mode=sync", "rollout.env=null"])))
    report = {"_phases": {"data": time.monotonic() - began}}
    try:
        phase = time.monotonic()
        first = session.start()
        report["_phases"]["start"] = time.monotonic() - phase
        phase = time.monotonic()
        step0 = first.save(0, root=os.path.join(out, "step0"))
        report["_phases"]["step0"] = time.monotonic() - phase
        # first: the session's weights after the last of RUNS are what the export below must equal
        for name, (overrides, steps) in AGENT_RUNS.items():
            run_started = time.monotonic()
            session.train_from(step0, os.path.join(out, name), [*overrides, f"trainer.total_steps={steps}"], raw=raw)
            report[name] = {"seconds": time.monotonic() - run_started}
        for name, (overrides, steps) in JUDGE_RUNS.items():
            run_started = time.monotonic()
            session.train_from(step0, os.path.join(out, name), [*overrides, f"trainer.total_steps={steps}"],
                               raw=raw_judge)
            report[name] = {"seconds": time.monotonic() - run_started}
        for name, (overrides, steps, start) in RUNS.items():
            run_started = time.monotonic()
            source = step0 if start == "step0" else checkpointing.step_dir(os.path.join(out, start[0], "ckpt"),
                                                                            start[1])
            total = steps + (0 if start == "step0" else start[1])
            session.train_from(source, os.path.join(out, name), [*overrides, f"trainer.total_steps={total}"], raw=raw,
                               rollout=SlowEngine(first.rollout) if name == "async" else None)
            seconds = time.monotonic() - run_started
            report[name] = {"seconds": seconds}
        # the workers' weights after the last run, as the tool quickstart writes its SFT model: `export_hf`
        exporting = time.monotonic()
        session.export_hf(os.path.join(out, "session_hf"))
        report["export_hf"] = {"seconds": time.monotonic() - exporting}
        # where each teacher ran: every rank's pool, pid and teacher calls, on the actor's pool and on "teach"
        report["_teacher_calls"] = {"actor_pool": session.workers.teacher_call_counts(),
                                    "teacher_pool": session.role_groups["teacher/pooled"].teacher_call_counts(),
                                    "engine_requests": session.engine_teachers["engine"].requests}
    finally:
        phase = time.monotonic()
        session.close()
        report["_phases"]["close"] = time.monotonic() - phase
    phase = time.monotonic()
    # the last run's final checkpoint, exported on its own: what the session's export must equal
    from megarl.checkpoint.export import export_hf

    last, (_, steps, start) = list(RUNS.items())[-1]
    final_step = steps + (0 if start == "step0" else start[1])
    export_hf(os.path.join(out, last, "ckpt", f"step_{final_step:06d}"), os.path.join(out, "checkpoint_hf"))
    export_hf(checkpointing.step_dir(os.path.join(out, "sync", "ckpt"), SYNC_STEPS), os.path.join(out, "student_hf"))
    report["_phases"]["exports"] = time.monotonic() - phase
    report["_phases"]["total"] = time.monotonic() - began
    report["_teacher"] = data["model"]
    report["_judge"] = judge
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
