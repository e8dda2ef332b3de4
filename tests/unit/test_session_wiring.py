"""One way to build a run: `megarl.trainer.session.TrainingSession` is the only place that starts Ray, places worker
groups and builds the RL loop; `megarl train`, the Python API, both quickstarts, the benchmarks and the e2e drivers
go through it (its `sft=True` / `sft_step` and `train_from`). Read with `ast` (nothing is imported) for the wiring;
the session's own refusals are checked on real configs without starting anything.
"""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SESSION = ROOT / "megarl" / "trainer" / "session.py"


def _calls(path: pathlib.Path) -> set[str]:
    """Names called in `path`: `f(...)` as "f", `a.b.f(...)` as "a.b.f" (the dotted name as written)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            if isinstance(func, ast.Name):
                out.add(".".join([func.id, *reversed(parts)]))
    return out


def _sources(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_only_the_session_builds_the_rl_loop():
    """`RLLoop(...)` appears in session.py and nowhere else in megarl/, benchmarks/, examples/ or tests/ (a run
    wired by hand elsewhere is what this issue removed: quickstarts, benchmarks/async.py, tests/e2e drivers)."""
    assert "RLLoop" in _calls(SESSION)  # the check below looks at the right spelling
    elsewhere = [str(p.relative_to(ROOT)) for p in _sources("megarl", "benchmarks", "examples", "tests")
                 if p != SESSION and any(c.split(".")[-1] == "RLLoop" for c in _calls(p))]
    assert elsewhere == [], f"RLLoop built outside TrainingSession: {elsewhere}; build the run with the session"


# Benchmarks of one component below a run (no RL loop, no roles), which place their own bare workers, with why.
COMPONENT_BENCHMARKS = {
    "benchmarks/prefix_cache.py": "two bare engine replicas (RolloutHost actors built from a model dir) behind the "
                                  "router: no actor, no config, nothing a session would build",
    "benchmarks/rollout_puts.py": "one bare actor timing Ray's object-store puts (per completion vs per poll round): "
                                  "no engine, no role, no config",
}


def test_only_the_session_starts_ray_and_worker_groups_in_the_package():
    """Within megarl/ and benchmarks/, `ray.init` and `WorkerGroup(...)` are called only by the session (the
    controller's own tests under tests/distributed place groups directly: they test the controller; so do the
    component benchmarks named in COMPONENT_BENCHMARKS, each with its reason)."""
    assert {"ray.init", "WorkerGroup"} <= _calls(SESSION)
    elsewhere = sorted(f"{p.relative_to(ROOT)}: {c}" for p in _sources("megarl", "benchmarks") if p != SESSION
                       and str(p.relative_to(ROOT)) not in COMPONENT_BENCHMARKS
                       for c in _calls(p) if c in ("ray.init", "WorkerGroup"))
    assert elsewhere == [], f"Ray / worker groups started outside TrainingSession: {elsewhere}"


def _cfg(tmp_path, *overrides):
    from megarl.config import load_config

    data = ROOT / "data" / "quickstart"
    return load_config(str(ROOT / "yaml_configs" / "cpu_quickstart.yaml"), [
        f"logging.dir={tmp_path / 'run'}", f"data.train_path={data / 'train.jsonl'}",
        f"data.val_path={data / 'val.jsonl'}", f"model.tokenizer={data / 'tokenizer'}", *overrides])


def test_an_sft_session_with_a_rollout_pool_is_refused_naming_the_key(tmp_path):
    """SFT steps run on `SFTWorker`, a hybrid-engine worker: with the engines on a pool of their own the session
    refuses at construction (nothing started), naming rollout.pool and both ways out."""
    import ray

    from megarl.config import ConfigError, load_config
    from megarl.trainer.session import TrainingSession

    cfg = load_config(str(ROOT / "yaml_configs" / "cpu_quickstart_rollout_pool.yaml"),
                      [f"logging.dir={tmp_path / 'run'}"])
    assert cfg.rollout.pool is not None
    with pytest.raises(ConfigError, match=r"^rollout.pool: .*set rollout.pool=null .* or drop the SFT phase"):
        TrainingSession(cfg, sft=True)
    assert not ray.is_initialized()


def test_sft_steps_need_an_sft_session(tmp_path):
    """A session built without `sft=True` has plain `HybridWorker`s: `sft_step` says how to get one, before any
    worker starts."""
    import ray

    from megarl.trainer.session import TrainingSession

    session = TrainingSession(_cfg(tmp_path))
    with pytest.raises(RuntimeError, match=r"TrainingSession\(cfg, sft=True\)"):
        session.sft_step(None, 1e-3)
    assert session.workers is None and not ray.is_initialized()
    session.close()
    assert os.path.isdir(session.run_dir)
