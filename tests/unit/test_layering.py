"""The package's layers: a module may import its own package and the packages *below* it, never one above.

Imports are read with `ast` from every module in `megarl/`, at module level and inside functions (a deferred
import is still a dependency). The order, lowest first:

  registry     `Registry` (name -> callable, lookups with did-you-mean): one module importing nothing of megarl,
               used by every layer that registers names (algorithms, config's messages, rewards, envs)
  platform     device, distributed init, megatron-core CPU compatibility, vendor version checks
  parallel     topology and process groups
  algorithms   pure tensor maths (advantages, losses, KL)
  models       GPTModel providers, ModelSpec
  config       frozen dataclasses, YAML, validation: above models and parallel because validation checks a
               config against `RoleTopology` and `ModelSpec` (refusing at load time what the workers would
               refuse); below everything that is built from a config
  engine       MegatronEngine: model + DDP + optimizer + schedule + offload + scalar heads
  checkpoint   HF <-> Megatron, distributed checkpoints of an engine
  data         datasets, tokenization, the batch protocol, micro-batching
  rewards      rule rewards and user reward functions: they score decoded samples (data), nothing above
  rollout      the rollout engine protocol, the request-level client protocol and vLLM
  envs         multi-turn environments, tools and tool-call parsers, and the episode loop that drives them against a
               rollout client (one request per turn): an episode's final answer is scored by a reward function
               (rewards); nothing in rollout knows of episodes
  serving      the OpenAI-compatible HTTP endpoint over a rollout client (renders chats as the episodes do)
  reshard      actor shards -> rollout engine layout (reads checkpoint's name maps, writes into rollout)
  roles        actor / critic / reference / reward model over the engine
  controller   Ray single controller: pools, worker groups, dispatch
  workers      what a pool's device slot runs: role and rollout hosts composed into the hybrid / role workers
               (dispatch-decorated methods over roles, rollout and reshard), below the trainer that drives them
  trainer      the RL loop and its workers
  api          the Python API (`megarl.RLTrainer`): a job from keyword arguments, run by the trainer's session
  cli          `megarl ...`, a thin layer over the API

`megarl/__init__.py` and `megarl/__main__.py` sit on top (they may import anything).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

LAYERS = ["registry", "platform", "parallel", "algorithms", "models", "config", "engine", "checkpoint", "data",
          "rewards", "rollout", "envs", "serving", "reshard", "roles", "controller", "workers", "trainer", "api", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megarl"


def layer_of(module: str) -> str | None:
    """'megarl.roles.base' -> 'roles'; None for modules outside the layers (megarl itself, other packages)."""
    parts = module.split(".")
    if parts[0] != "megarl" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source` (any depth), relative imports resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            out.append((node.lineno, name))
            # `from megarl import roles` names a package in the alias
            if name == "megarl":
                out += [(node.lineno, f"megarl.{a.name}") for a in node.names]
    return out


def violations(sources: dict[str, str]) -> list[str]:
    """'module:line imports target (layer a above layer b)' for every upward import in `sources`
    (module name -> source text)."""
    found = []
    for module, source in sorted(sources.items()):
        own = layer_of(module)
        if own is None:
            continue
        for line, target in imported_modules(source, module):
            theirs = layer_of(target)
            if theirs is not None and RANK[theirs] > RANK[own]:
                found.append(f"{module}:{line} imports {target} ({theirs} is above {own})")
    return found


def package_sources() -> dict[str, str]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def test_every_package_is_placed():
    packages = {p.name for p in PACKAGE.iterdir() if (p.is_dir() and (p / "__init__.py").exists())}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert packages - set(LAYERS) == set(), "place the new package in LAYERS (and say why in the docstring)"


def test_no_layer_imports_a_higher_one():
    found = violations(package_sources())
    assert found == [], "upward imports:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from megarl.roles.base import Role\n",  # module level
    "def f():\n    from megarl.roles import Actor\n",  # deferred, inside a function
    "import megarl.trainer.rl_trainer\n",
    "from ..roles import base\n",  # relative
    "from megarl import controller\n",
])
def test_an_upward_import_is_caught(source):
    found = violations({"megarl.checkpoint.engine_io": source})
    assert len(found) == 1 and "above checkpoint" in found[0]


def test_downward_and_sideways_imports_pass():
    src = "from megarl.engine import MegatronEngine\nfrom megarl.checkpoint.hf_io import HFReader\nimport torch\n"
    assert violations({"megarl.checkpoint.engine_io": src}) == []
