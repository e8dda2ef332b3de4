"""`TeacherEngineHost`: one rank of a vLLM-served distillation teacher's engines
(`distillation.teachers.<name>.backend: vllm`), on the teacher's pool of its own.

A `RolloutHost` (as the judge's `JudgeHost`) whose engine reads the teacher's own weights from its `path` (an HF
directory, `load_format="auto"`) in the run's model.dtype and is never weight-synced: nothing pushes into it, it never
sleeps, and it serves for the whole run (`megarl.controller.serving.start_serving` over the group, stopped when the
session closes). One replica per `parallel.tp` consecutive ranks of the pool; the controller's
`megarl.rollout.teacher_engine.EngineTeacher` sends it one prompt log-probs request per row of a step's batch.
"""

from __future__ import annotations

from megarl.config.schema import JobConfig
from megarl.workers.rollout_host import VLLM_DTYPES, RolloutHost


class TeacherEngineHost(RolloutHost):
    """The vLLM engine of one rank of a teacher's pool (see the module docstring)."""

    sleeps_between_rollouts = False  # the teacher's pool is its engines' own
    keeps_completions = False  # its one new token per request is never trained on: nothing to put

    def __init__(self, cfg: JobConfig, teacher: str) -> None:
        """Build this rank's engine of teacher `teacher` (a name of distillation.teachers; a collective over the
        teacher pool's world). Its prompts: a whole row of the batch, up to rollout.max_prompt_tokens +
        rollout.max_new_tokens tokens; its answers: one token."""
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine, resolve_enforce_eager

        t = cfg.distillation.teachers[teacher]
        longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
        self.engine = VllmRolloutEngine(VllmEngineSettings(
            model_path=t.path, tp=t.parallel.tp, dtype=VLLM_DTYPES[cfg.model.dtype], seed=0, load_format="auto",
            max_model_len=longest + 1, max_prompt_tokens=longest, overlong_prompt="error",
            kv_cache_gib=cfg.rollout.kv_cache_gib, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            enforce_eager=resolve_enforce_eager(cfg.rollout.enforce_eager, cfg.resources.device == "cpu"),
        ))
        self._awake = {"weights", "kv_cache"}

    def _refill_weights(self) -> None:
        raise RuntimeError("the teacher engine never sleeps: its weights cannot have been dropped")
