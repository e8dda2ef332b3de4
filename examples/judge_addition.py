"""A judge run on CPU: GRPO on the quickstart's addition task, every response scored by an LLM judge (`reward.judge`)
instead of the exact-match rule.

    python examples/judge_addition.py runs/judge_addition [--steps 3]

Writes under OUT: data/ (the quickstart's addition task and its random start model, `megarl.data.arithmetic`),
judge_model/ (a tiny random Llama with the byte-level BPE chat tokenizer of `megarl.data.chat_bpe`: a "small model"
that runs on CPU; its scores carry no knowledge of addition, the run shows the machinery), config.yaml, and the run's
metrics.jsonl. The judge runs on a pool of its own (`judge`, one CPU worker), served by a vLLM engine that is never
weight-synced; each response is shown to it through TEMPLATE, and its score is P(Yes)/(P(Yes)+P(No)) of its next
token (parse: yes_no_logprob). Printed at the end: each step's reward and judge/... metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TEMPLATE = ("Question: what is {question}\nResponse: {response}\nReference answer: {reference}\n"
            "Is the response correct? Answer Yes or No.")


def build_judge_model(path: str) -> str:
    """A tiny random Llama (vocabulary 400) with the BPE chat tokenizer (it has a ChatML chat template)."""
    from megarl.checkpoint.tiny import build_tiny_llama
    from megarl.data.chat_bpe import build_chat_bpe_tokenizer

    build_tiny_llama(path, vocab_size=400)
    build_chat_bpe_tokenizer(path, 400)  # replaces build_tiny_llama's WordLevel tokenizer
    return path


def job_config(out: str, data: dict, judge_model: str, steps: int, function_weight: float = 0.0) -> dict:
    """The quickstart's GRPO job (`megarl.trainer.quickstart.job_config`), short, with reward.judge on pool judge
    (`function_weight`: reward.function's exact-match score beside the judge's)."""
    from megarl.trainer.quickstart import QuickstartSettings
    from megarl.trainer.quickstart import job_config as quickstart_job

    settings = QuickstartSettings(out=out, grpo_steps=steps, prompts_per_step=8, samples_per_prompt=4, val_every=0,
                                  sft_batch=32)
    raw = quickstart_job(settings, data)
    raw["resources"]["pools"]["judge"] = {"nodes": 1, "devices_per_node": 1}
    raw["reward"] = {"judge": {"model": judge_model, "pool": "judge", "template": TEMPLATE,
                               "parse": "yes_no_logprob", "max_prompt_tokens": 256, "max_concurrent": 16,
                               "function_weight": function_weight}}
    raw["checkpoint"] = {"dir": None}
    raw["logging"]["plots"] = False
    return raw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--function-weight", type=float, default=0.0,
                   help="reward = judge score + this x exact match (reward.judge.function_weight)")
    args = p.parse_args(argv)
    import logging

    import yaml

    from megarl.config.loader import dump_yaml, parse_config
    from megarl.config.validate import validate
    from megarl.data.arithmetic import build_arithmetic
    from megarl.trainer.session import TrainingSession

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = os.path.abspath(args.out)
    data = build_arithmetic(os.path.join(out, "data"), n_val=200)
    judge_model = build_judge_model(os.path.join(out, "judge_model"))
    cfg = validate(parse_config(job_config(out, data, judge_model, args.steps, args.function_weight)))
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(dump_yaml(cfg))
    session = TrainingSession(cfg)
    try:
        results = session.fit()
    finally:
        session.close()
    keys = ("reward/mean", "judge/requests", "judge/cache_hits", "judge/parse_failures", "judge/errors",
            "judge/latency_s", "judge/score_mean", "judge/function_score_mean", "time/reward_overlap_s")
    rows = [{k: r.metrics.get(k) for k in keys} for r in results]
    print(yaml.safe_dump({"steps": rows}, sort_keys=False))
    with open(os.path.join(out, "judge_metrics.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
