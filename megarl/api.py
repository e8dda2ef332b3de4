"""The Python API: build a job from keyword arguments or a config, train it, sample from it, save and export it.

    import megarl

    def reward(response: str, answer, record) -> float:      # any Python callable, no file needed
        return float(response.strip() == answer)

    with megarl.RLTrainer(model="path/to/hf", reward=reward, train_data=[{"prompt": "2+2=", "answer": "4"}, ...],
                          algorithm="grpo", actor={"tp": 2, "lr": 1e-6}, data={"prompts_per_step": 8},
                          trainer={"total_steps": 100}) as trainer:
        trainer.fit()                                       # or: metrics = trainer.step()
        print(trainer.generate(["2+2="]))
        trainer.export_hf("out/hf")

It is the engine `megarl train` runs (the CLI is a thin layer over `RLTrainer`): the same config, validation and
error messages (naming the dotted key: `actor.parallel.tp: ...`), the same `megarl.trainer.session.TrainingSession`
(Ray worker groups, the RL loop `megarl.trainer.rl_trainer.RLLoop`), the same run directory (metrics.jsonl,
plots, TensorBoard / W&B), checkpoint manager and HF export.

How keyword arguments map onto `JobConfig` (docs/config.md lists every key):
  config=        base config: a `JobConfig`, a YAML path, or a mapping; keyword arguments override it. A `JobConfig`
                 from `load_config` is resolved (the algorithm preset's losses filled in): to switch `algorithm=`
                 presets, start from the YAML path or a mapping instead
  model=         "path/to/hf" -> model.path (an inline `arch` of the base is dropped), or a `model` mapping
  reward=        a callable fn(response_text, answer, record) -> float, a registered reward name, or a mapping
  train_data=    a list of records (dicts with data.prompt_key / data.answer_key) or a .jsonl/.parquet path;
  val_data=      lists are written to RUN_DIR/data/{train,val}.jsonl so the config (and a checkpoint) can name them
  algorithm=     "grpo" -> algorithm.name, or an `algorithm` mapping
  run_dir=       -> logging.dir
  overrides=     dotted key=value strings, exactly as on the command line
  <section>={..} any top-level section (actor, rollout, data, trainer, logging, ...). Inside a section, a key that
                 is not the section's own but belongs to exactly one of its sub-sections goes there: actor={"tp": 2}
                 is actor.parallel.tp, actor={"lr": 1e-6} is actor.optimizer.lr, algorithm={"coef": 0.001} is
                 algorithm.kl.coef.

Reward callables run on the controller (this process, in `RLLoop.step`'s scoring), never in a Ray worker, so they
are never pickled: lambdas, closures, functions defined in a notebook or `__main__`, and callables holding
unpicklable state (a database connection, a lock) all work. `reward.on_error` / `timeout_s` apply to them as to
file rewards. The checkpointed config records the callable's name (`python:<module>.<qualname>`); to resume such a
run pass the same callable again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

from megarl.config import ConfigError, JobConfig, apply_overrides, from_dict, to_dict, validate
from megarl.config.errors import did_you_mean
from megarl.config.loader import read_yaml

__all__ = ["JobConfig", "RLTrainer", "build_config"]

ConfigLike = Union[JobConfig, str, os.PathLike, Mapping, None]
ARGUMENTS = ("config", "model", "reward", "train_data", "val_data", "algorithm", "run_dir", "overrides")


# --------------------------------------------------------------------------------------------------- config


def _section_types(cls: type) -> dict[str, type]:
    """Field name -> dataclass type, for the fields of `cls` that are sections (nested dataclasses)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])}


def _expand(cls: type, values: Mapping, path: str) -> dict:
    """`values` for section `cls` with shorthand keys moved into the one sub-section that owns them
    (actor: tp -> parallel.tp). Unknown or ambiguous keys are left in place: `from_dict` then names them."""
    own = {f.name for f in dataclasses.fields(cls)}
    subs = _section_types(cls)
    out: dict = {}
    for key, value in values.items():
        if key in subs and isinstance(value, Mapping):
            value = _expand(subs[key], value, f"{path}.{key}")
        owners = [name for name, sub in subs.items() if key in {f.name for f in dataclasses.fields(sub)}]
        if key not in own and len(owners) == 1:
            out.setdefault(owners[0], {})
            if not isinstance(out[owners[0]], dict):
                raise ConfigError(f"{path}.{owners[0]}: expected a mapping (section), got {out[owners[0]]!r}")
            out[owners[0]][key] = value
        elif key in out and isinstance(out[key], dict) and isinstance(value, Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _merge(base: Mapping, extra: Mapping) -> dict:
    """Recursive dict merge; `extra` wins."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in base.items()}
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _base_data(config: ConfigLike) -> dict:
    if config is None:
        return {}
    if isinstance(config, JobConfig):
        return to_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return read_yaml(config)
    if isinstance(config, Mapping):
        return _merge({}, config)
    raise ConfigError(f"config: expected a JobConfig, a YAML path or a mapping, got {type(config).__name__}")


def _write_records(records: Sequence[Mapping], path: str, key: str) -> str:
    """Write in-memory records as JSON lines (the dataset loader's format); errors name the record."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for i, record in enumerate(records):
            if not isinstance(record, Mapping):
                raise ConfigError(f"{key}[{i}]: a record is a mapping of columns (prompt, answer, ...), got "
                                  f"{type(record).__name__}")
            try:
                f.write(json.dumps(dict(record)) + "\n")
            except TypeError as e:
                raise ConfigError(f"{key}[{i}]: not JSON-serialisable: {e}") from None
    return path


def reward_name(fn: Callable) -> str:
    """The name a Python reward callable is recorded under in the config: python:<module>.<qualname>."""
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"python:{getattr(fn, '__module__', None) or '?'}.{qualname}"


def build_config(config: ConfigLike = None, *, model: Union[str, Mapping, None] = None,
                 reward: Union[Callable, str, Mapping, None] = None,
                 train_data: Union[str, os.PathLike, Sequence[Mapping], None] = None,
                 val_data: Union[str, os.PathLike, Sequence[Mapping], None] = None,
                 algorithm: Union[str, Mapping, None] = None, run_dir: Optional[str] = None,
                 overrides: Iterable[str] = (), **sections: Any) -> tuple[JobConfig, Optional[Callable]]:
    """The validated `JobConfig` of `RLTrainer`'s arguments (see the module docstring) and the reward callable
    (None when the config names the reward). Raises ConfigError naming the key, as `megarl train` does."""
    fields = [f.name for f in dataclasses.fields(JobConfig)]
    for key in sections:
        if key not in fields:
            names = [*ARGUMENTS, *fields]
            raise ConfigError(f"unknown argument {key!r}{did_you_mean(key, names)}; RLTrainer takes "
                              f"{', '.join(ARGUMENTS)} and the config sections {', '.join(fields)}")
    data = _base_data(config)
    extra: dict[str, Any] = dict(sections)
    if model is not None:
        if isinstance(model, (str, os.PathLike)):
            data["model"] = {k: v for k, v in data.get("model", {}).items() if k != "arch"}
            model = {"path": os.fspath(model)}
        extra["model"] = _merge(extra.get("model", {}), model)
    fn = None
    if reward is not None:
        if callable(reward):
            fn, reward = reward, {"function": reward_name(reward), "file": None}
        elif isinstance(reward, str):
            reward = {"function": reward}
        extra["reward"] = _merge(extra.get("reward", {}), reward)
    if algorithm is not None:
        extra["algorithm"] = _merge(extra.get("algorithm", {}), {"name": algorithm} if isinstance(algorithm, str)
                                    else algorithm)
    if run_dir is not None:
        extra["logging"] = _merge(extra.get("logging", {}), {"dir": os.fspath(run_dir)})
    types = _section_types(JobConfig)
    for key, value in extra.items():
        if key in types and isinstance(value, Mapping):
            value = _expand(types[key], value, key)
        data[key] = _merge(data[key], value) if isinstance(data.get(key), Mapping) and isinstance(value, Mapping) \
            else value
    data = apply_overrides(data, overrides)
    log_dir = (data.get("logging") or {}).get("dir") or JobConfig.__dataclass_fields__["logging"].default_factory().dir
    for split, records in (("train", train_data), ("val", val_data)):
        if records is None:
            continue
        if isinstance(records, (str, os.PathLike)):
            path = os.fspath(records)
        else:
            path = _write_records(records, os.path.join(os.path.abspath(log_dir), "data", f"{split}.jsonl"),
                                  f"{split}_data")
        data.setdefault("data", {})[f"{split}_path"] = path
    return validate(from_dict(JobConfig, data)), fn


# --------------------------------------------------------------------------------------------------- trainer


class RLTrainer:
    """A training job you drive from Python. Construction builds and validates the config and checks every input
    (data, tokenizer, reward, checkpoint dir) without starting anything; the Ray cluster and the workers start on
    the first `fit`, `step` or `generate`, and stop on `close()` (or leaving the `with` block).

    Attributes: `config` (the resolved `JobConfig`), `run_dir` (metrics.jsonl, plots/, data/).
    """

    def __init__(self, config: ConfigLike = None, *, resume_command: Optional[str] = None, **kwargs: Any) -> None:
        from megarl.trainer.session import TrainingSession  # torch-free, but pulls the controller in

        self.config, reward_fn = build_config(config, **kwargs)
        self.resume_command = resume_command
        self._session = TrainingSession(self.config, reward_fn=reward_fn)
        self.run_dir = self._session.run_dir

    # -- training ---------------------------------------------------------------------------------------------

    def fit(self) -> list[dict[str, float]]:
        """Run the remaining steps up to `trainer.total_steps` (after a resume or earlier `step()` calls), then
        print the summary table and write the plots (`logging.plots`). Returns each step's metrics (as `step`)."""
        from megarl.trainer import fit_and_report

        return [{"step": r.step, **r.metrics} for r in fit_and_report(self._session, self.resume_command)]

    def step(self) -> dict[str, float]:
        """Run one RL step (rollout, reward, log-probs, advantages, updates, reshard; validation and checkpoint at
        their cadence) and return its metrics: the row written to metrics.jsonl (`step`, `reward/mean`,
        `actor/loss`, `actor/kl`, `time/step_s`, ...). Raises RuntimeError once `trainer.total_steps` have run."""
        r = self._session.step()
        return {"step": r.step, **r.metrics}

    @property
    def steps_done(self) -> int:
        """Steps finished so far (including those of a resumed checkpoint); 0 before the workers start."""
        trainer = self._session.trainer
        return max(0, trainer.next_step - 1) if trainer is not None else 0

    # -- using the policy ---------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Union[str, list]], n: int = 1, **sampling: Any):
        """Sample from the current policy through the rollout engine (vLLM, with the actor's latest weights).
        `prompts`: strings or chat message lists (formatted with `data.chat_template`). Sampling defaults to the
        validation settings (`rollout.val_temperature`, greedy by default; `rollout.max_new_tokens`); override any
        `SamplingSettings` field: temperature, top_p, top_k, max_new_tokens, stop, seed. Returns one string per
        prompt, or a list of `n` strings per prompt when n > 1; a prompt longer than rollout.max_prompt_tokens
        (with rollout.overlong_prompt=drop) gets None."""
        from megarl.rollout.engine import SamplingSettings

        fields = {f.name for f in dataclasses.fields(SamplingSettings)} - {"samples_per_prompt"}
        unknown = sorted(set(sampling) - fields)
        if unknown:
            raise ValueError(f"generate: unknown sampling option(s) {unknown}; valid: {sorted(fields)}")
        settings = SamplingSettings.from_config(self.config.rollout, validation=True, samples_per_prompt=n,
                                                **sampling)
        trainer = self._session.start()
        trainer.start()  # the engine holds the actor's weights from here on
        encoded = [trainer.encoder.encode(p) for p in prompts]
        with trainer.schedule.exclusive():  # in async mode the engines are shared with the rollout driver thread
            samples, _ = trainer.sample(encoded, settings)
        texts: list[list[str]] = [[] for _ in prompts]
        for s in samples:
            texts[s.prompt_index].append(trainer.encoder.decode(s.response_ids))
        if n == 1:
            return [t[0] if t else None for t in texts]
        return [t or None for t in texts]

    # -- checkpoints and export ---------------------------------------------------------------------------------

    def save(self, path: Optional[str] = None) -> str:
        """Checkpoint the full training state (the checkpoint manager of `megarl train`: weights, optimizer, RNG,
        data position; resumable with checkpoint.resume=true) into `path/step_NNNNNN`; `path` defaults to
        `checkpoint.dir`, else RUN_DIR/checkpoints. Returns the step directory (an existing complete one of the
        same step is returned as is)."""
        from megarl.trainer import checkpointing

        trainer = self._session.start()
        trainer.start()
        root = os.path.abspath(path or self.config.checkpoint.dir or os.path.join(self.run_dir, "checkpoints"))
        step = self.steps_done
        if step in checkpointing.complete_steps(root):
            return checkpointing.step_dir(root, step)
        return trainer.save(step, root=root)

    def export_hf(self, out: str, overwrite: bool = False, max_shard_gb: float = 2.0) -> dict:
        """Write the current actor as a HuggingFace model directory `out` (safetensors, config.json, tokenizer):
        `save()`, then what `megarl export` does with that checkpoint. The job's tokenizer is written beside the weights
        when the checkpoint carries none (a model built from an inline `model.arch` and a separate `model.tokenizer`),
        so `out` loads with `AutoTokenizer` / `AutoModelForCausalLM` either way. Returns {"out", "source", "bytes"}."""
        from megarl.checkpoint.export import export_hf

        stats = export_hf(self.save(), out, overwrite=overwrite, max_shard_gb=max_shard_gb)
        if not os.path.exists(os.path.join(out, "tokenizer_config.json")):
            self._session.encoder.tokenizer.save_pretrained(out)
        return stats

    # -- lifetime -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers, remove their shared memory, close the metric sinks and stop the Ray cluster this
        trainer started. Idempotent."""
        self._session.close()

    def __enter__(self) -> "RLTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
