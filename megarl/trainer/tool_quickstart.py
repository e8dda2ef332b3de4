"""`megarl quickstart --task tools`: SFT on tool-call demonstrations, then multi-turn GRPO with the calculator, teach
a small random Llama to answer two-digit multiplications through the tool.

Stages (like the addition quickstart, `megarl.trainer.quickstart`; times in OUT/summary.json):
  1. data   `megarl.data.tool_task`: 8100 problems "a*b=", `n_val` held out; the character-level ChatML tokenizer
            (`megarl.data.chat_chars`) and a random HF Llama -> OUT/data/.
  2. setup  the GRPO job's `TrainingSession` (sft=True): a local Ray cluster, 2 worker processes (Megatron
            actor TP2 + a vLLM TP1 engine each, the reshard).
  3. sft    `sft_steps` steps of cross-entropy on demonstration episodes (`demonstration`: the tool call
            and the final answer are the loss mask, the tool's output is context); `direct_fraction` of them answer
            at once without the tool, so the warmed-up model calls it on only part of the problems and GRPO has to
            learn that calling it pays. The warmed-up model is written as a HuggingFace directory, OUT/sft_model
            (`TrainingSession.export_hf`, atomic): the model.path of yaml_configs/cpu_tools_quickstart.yaml and
            yaml_configs/cpu_agent_quickstart.yaml, so `megarl train` starts from it.
  4. grpo   the job of `yaml_configs/cpu_tools_quickstart.yaml` (paths set to OUT): multi-turn episodes with the
            calculator environment (`rollout.env`), exact-match reward on the final turn, GRPO over the episodes of
            one problem; metrics in OUT/metrics.jsonl, plots in OUT/plots (reward and tool use).
  5. eval   greedy episodes (temperature 0) on every held-out problem after each stage: accuracy (the reward) and
            the fraction of episodes whose tool calls all parsed and ran (`multi_turn/tool_success_frac`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time

logger = logging.getLogger("megarl.quickstart")
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "yaml_configs",
                      "cpu_tools_quickstart.yaml")


@dataclasses.dataclass
class ToolQuickstartSettings:
    out: str = "runs/tool_quickstart"
    n_val: int = 64
    sft_batch: int = 32
    sft_lr: float = 2e-3
    # the copy of the tool's result into the answer is learned suddenly, after a plateau whose length moves with
    # the seed and the CPU's fp32 kernels (about 250 to over 400 steps); 600 leaves that margin
    sft_steps: int = 600
    # the last steps' learning rate falls linearly to 0 (sft_lr before them): the warm-up ends settled, not on
    # whichever noisy step of a constant rate comes last
    sft_decay_steps: int = 200
    # demonstrations that answer at once, without the tool: the warmed-up model then calls the tool on about this
    # fraction fewer problems, and GRPO has the choice to learn (only the calls get the product right). Below 0.5:
    # greedy decoding calls the tool only where "<tool_call>" outweighs the likeliest first digit of a direct answer,
    # at most this fraction, whose first digit the model learns (at 0.5 the two tie wherever it knows it)
    direct_fraction: float = 0.4
    grpo_steps: int = 60
    seed: int = 0
    vendor_level: str = "error"


def demonstration(tokenizer, record, tools, uid: str = "demo", with_tool: bool = True):
    """The calculator episode of `record` (module docstring) as a `Trajectory` whose loss mask covers the two
    assistant turns, each ending with the end-of-turn token; `with_tool=False`: the answer given at once, no call
    (a demonstration the model cannot learn to follow reliably: it cannot multiply)."""
    from megarl.data.tool_task import tool_call_text
    from megarl.data.trajectory import TrajectoryBuilder
    from megarl.envs.episode import ChatRenderer

    prompt = record.prompt if hasattr(record, "prompt") else record["prompt"]
    answer = record.answer if hasattr(record, "answer") else record["answer"]
    renderer = ChatRenderer(tokenizer, tools)
    user = [{"role": "user", "content": prompt}]
    call = tool_call_text(prompt.rstrip("="))
    eos = tokenizer.eos_token_id
    call_ids = tokenizer(call, add_special_tokens=False)["input_ids"] + [eos]
    conversation = user + [{"role": "assistant", "content": call}]
    observation = renderer.observation(conversation, [{"role": "tool", "name": "calculator", "content": answer}], eos)
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
    if not with_tool:
        return (TrajectoryBuilder(renderer.prompt(user), uid=uid, group_uid=uid)
                .sampled(answer_ids, [0.0] * len(answer_ids), 0).build("stop"))
    return (TrajectoryBuilder(renderer.prompt(user), uid=uid, group_uid=uid)
            .sampled(call_ids, [0.0] * len(call_ids), 0).context(observation)
            .sampled(answer_ids, [0.0] * len(answer_ids), 0).build("stop"))


def greedy_episodes(runner, service, records, version: int) -> dict:
    """Greedy (temperature 0) episodes of every record through `service`'s request servers (a `RolloutService`:
    `with service.serving() as client`, one coroutine per episode): {"accuracy": mean episode reward,
    "multi_turn/...": the episodes' metrics}. `version`: the weights version the tokens record where the engines
    report none."""
    from megarl.rollout.engine import SamplingSettings

    sampling = SamplingSettings(temperature=0.0, seed=0)
    with service.serving() as client:
        result = runner.run(records, 1, client, sampling, version, uid_prefix="eval/")
    return {"accuracy": sum(result.scores) / max(len(result.scores), 1), **result.metrics}


def run_tool_quickstart(s: ToolQuickstartSettings) -> dict:
    """Run every stage (module docstring); returns the summary written to OUT/summary.json."""
    from megarl.platform.vendor_logs import quiet_vendors

    quiet_vendors(s.vendor_level)
    import yaml

    from megarl.config.loader import apply_overrides, parse_config
    from megarl.config.validate import validate
    from megarl.controller import serving
    from megarl.data.dataset import PromptDataset
    from megarl.data.tool_task import build_tool_task
    from megarl.data.trajectory import trajectories_to_batch
    from megarl.envs.episode import runner_from_config
    from megarl.rollout.service import ColocatedRollout
    from megarl.trainer.plots import PlotsUnavailable, plot_run
    from megarl.trainer.session import TrainingSession

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = os.path.abspath(s.out)
    if os.path.exists(os.path.join(out, "summary.json")) or os.path.exists(os.path.join(out, "sft_model")):
        from megarl.config import ConfigError

        raise ConfigError(f"--out {out} holds an earlier quickstart run; choose another directory or remove it")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    times: dict[str, float] = {}
    data = build_tool_task(os.path.join(out, "data"), n_val=s.n_val, seed=s.seed)
    raw = apply_overrides(yaml.safe_load(open(CONFIG)), [
        f"model.path={data['model']}", f"data.train_path={data['train']}", f"data.val_path={data['val']}",
        f"logging.dir={out}", f"trainer.total_steps={s.grpo_steps}", f"rollout.seed={s.seed}",
        f"data.seed={s.seed}", f"logging.vendor_level={s.vendor_level}"])
    cfg = validate(parse_config(raw))
    train = list(PromptDataset.from_config(cfg.data, split="train"))
    val = list(PromptDataset.from_config(cfg.data, split="val"))
    # the GRPO job's session (its loader, reward, held-out records), its workers able to take SFT steps too
    session = TrainingSession(cfg, sft=True)
    encoder = session.encoder
    runner = runner_from_config(cfg, encoder, session.reward_fn)
    tools = runner.env_factory(val[0]).tools()
    times["data_s"] = time.perf_counter() - t0

    summary = {}
    try:
        t = time.perf_counter()
        workers = session.start_workers()
        workers.sync_weights()
        times["setup_s"] = time.perf_counter() - t
        service = ColocatedRollout(workers, serving_backend=serving)  # the evaluations' request servers
        initial = greedy_episodes(runner, service, val, 0)
        logger.info("random model: accuracy %.3f, tool calls ok %.3f", initial["accuracy"],
                    initial["multi_turn/tool_success_frac"])

        t = time.perf_counter()
        rng = random.Random(s.seed + 2)
        sft_curve = []
        for step in range(1, s.sft_steps + 1):
            demos = [demonstration(encoder.tokenizer, r, tools, uid=f"sft{step}/{i}",
                                   with_tool=rng.random() >= s.direct_fraction)
                     for i, r in enumerate(rng.sample(train, s.sft_batch))]
            batch = trajectories_to_batch(demos, pad_id=encoder.pad_token_id or 0)
            m = session.sft_step(batch, s.sft_lr * min(1.0, (s.sft_steps - step + 1) / max(s.sft_decay_steps, 1)))
            if step % 20 == 0 or step == s.sft_steps:
                sft_curve.append({"step": step, "loss": m["loss"]})
                logger.info("sft step %d loss %.4f", step, m["loss"])
        workers.sync_weights()
        times["sft_s"] = time.perf_counter() - t
        t = time.perf_counter()
        sft_model = session.export_hf(os.path.join(out, "sft_model"))["out"]  # the model GRPO starts from
        times["export_s"] = time.perf_counter() - t
        logger.info("the SFT stage's model as a HuggingFace directory: %s (the model.path of "
                    "yaml_configs/cpu_tools_quickstart.yaml and cpu_agent_quickstart.yaml)", sft_model)
        after_sft = greedy_episodes(runner, service, val, 0)
        logger.info("after SFT (%d steps): accuracy %.3f, tool calls ok %.3f", s.sft_steps, after_sft["accuracy"],
                    after_sft["multi_turn/tool_success_frac"])

        t = time.perf_counter()
        results = session.fit()
        times["grpo_s"] = time.perf_counter() - t
        after_grpo = greedy_episodes(runner, service, val, len(results))
        logger.info("after GRPO (%d steps): accuracy %.3f, tool calls ok %.3f", len(results),
                    after_grpo["accuracy"], after_grpo["multi_turn/tool_success_frac"])
        rows = [r.metrics for r in results]
        summary = {
            "task": f"two-digit multiplication a*b= through the calculator tool, {len(train)} training / {len(val)} "
                    "held-out problems",
            "eval_kind": "greedy episodes (temperature 0), exact match of the final turn, every held-out problem",
            "initial": initial, "after_sft": after_sft, "after_grpo": after_grpo,
            "sft_steps": s.sft_steps, "sft_batch": s.sft_batch, "sft_lr": s.sft_lr, "sft_curve": sft_curve,
            "sft_model": sft_model,
            "grpo_steps": len(results), "grpo_reward_mean": [r["reward/mean"] for r in rows],
            "grpo_tool_success_frac": [r.get("multi_turn/tool_success_frac") for r in rows],
        }
    finally:
        session.close()
    try:
        summary["plots"] = plot_run(out)
    except PlotsUnavailable as e:
        logger.warning("%s", e)
        summary["plots"] = []
    times["total_s"] = time.perf_counter() - t0
    summary.update({f"time_{k}": v for k, v in times.items()})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"held-out greedy accuracy (tool calls that parsed and ran): random {initial['accuracy']:.3f} "
          f"({initial['multi_turn/tool_success_frac']:.3f}) -> after SFT {after_sft['accuracy']:.3f} "
          f"({after_sft['multi_turn/tool_success_frac']:.3f}) -> after GRPO {after_grpo['accuracy']:.3f} "
          f"({after_grpo['multi_turn/tool_success_frac']:.3f}); {times['total_s']:.0f} s; "
          f"summary in {os.path.join(out, 'summary.json')}")
    return summary
