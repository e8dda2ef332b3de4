"""One class per public name, and no module reaching into another module's private names.

Read with `ast` from every module in `megarl/` (nothing is imported). The rules:

1. **One class per public name.** A class defined at a module's top level (also inside a top-level `if` / `try`)
   whose name does not start with `_` is defined nowhere else in `megarl/`. Two `RLTrainer`s, or a `Reference`
   that is the reference policy in one module and a logits reference in another, make every "which one?" a
   question for the reader. Private classes (`_Name`) and classes nested in functions or classes are exempt.

2. **No private name crosses a module boundary.** A name with one leading underscore (`_x`, not `__x__`) is its
   module's own: no other module of `megarl/` uses it, whether by `from megarl.a.b import _x` (absolute or
   relative, at any depth, a deferred import inside a function included) or as an attribute, `b._x` / `X._x`,
   where `b` / `X` is bound by an import from a `megarl` module. There is no exception for a package's
   `__init__.py` re-exporting a submodule's private name: a name worth re-exporting is public. What two modules
   share gets a public name (and a docstring) in the module that owns it.

3. **A private module is its package's.** A module whose own name starts with `_` (`megarl/algorithms/
   _vocab_parallel.py`) is imported only by modules of the package it sits in.

Tests, benchmarks and examples are exempt: they may reach into internals to test them.
"""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megarl"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_sources() -> dict[str, tuple[str, bool]]:
    """{module name: (source, is a package's __init__)} for every module in megarl/."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path.read_text(), is_package)
    return out


def top_level_classes(tree: ast.Module) -> list[ast.ClassDef]:
    """Classes at module level, including those inside top-level `if` / `try` / `with` blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef):
            out.append(node)
        elif isinstance(node, ast.With):
            todo += node.body
        elif isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def duplicate_classes(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'Name: module:line, module:line' for every public class name defined in more than one place."""
    where: dict[str, list[str]] = defaultdict(list)
    for module, (source, _) in sorted(sources.items()):
        for node in top_level_classes(ast.parse(source)):
            if not node.name.startswith("_"):
                where[node.name].append(f"{module}:{node.lineno}")
    return [f"{name}: {', '.join(places)}" for name, places in sorted(where.items()) if len(places) > 1]


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module an ImportFrom reads from, relative levels resolved against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]  # level 1 is the package holding `module`
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'module:line what' for every use of another megarl module's private name (rules 2 and 3)."""
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        tree = ast.parse(source)
        package = module if is_package else module.rpartition(".")[0]
        bound: dict[str, str] = {}  # local name -> the megarl module or object it was imported as
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                origin = _absolute(module, is_package, node)
                if origin.split(".")[0] != "megarl":
                    continue
                for alias in node.names:
                    target = f"{origin}.{alias.name}"
                    if _is_private(alias.name):
                        found.append(f"{module}:{node.lineno} imports {alias.name} from {origin}")
                    else:
                        found += [f"{module}:{node.lineno} imports private module {m}"
                                  for m in _foreign_private_modules(origin, package)]
                    bound[alias.asname or alias.name] = target
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "megarl":
                        continue
                    found += [f"{module}:{node.lineno} imports private module {m}"
                              for m in _foreign_private_modules(alias.name, package)]
                    if alias.asname:  # import megarl.a.b as m: binds m to megarl.a.b
                        bound[alias.asname] = alias.name
                    else:  # import megarl.a.b: binds megarl
                        bound["megarl"] = "megarl"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in bound:
                    found.append(f"{module}:{node.lineno} uses {ast.unparse(node)} ({root.id} is {bound[root.id]})")
    return found


def _foreign_private_modules(dotted: str, package: str) -> list[str]:
    """The private modules on the path `dotted` (megarl.a._b.c -> megarl.a._b) outside `package` (the importer's)."""
    parts = dotted.split(".")
    out = []
    for i, part in enumerate(parts):
        if _is_private(part):
            owner = ".".join(parts[:i])
            if not (package == owner or package.startswith(owner + ".")):
                out.append(".".join(parts[: i + 1]))
    return out


def test_every_public_class_name_is_defined_once():
    found = duplicate_classes(package_sources())
    assert found == [], "public class names defined more than once in megarl/ (rename one):\n" + "\n".join(found)


def test_no_module_uses_another_modules_private_names():
    found = private_uses(package_sources())
    assert found == [], ("private names used across modules (give the name a public one in its owner):\n"
                         + "\n".join(found))


# ------------------------------------------------------------------------------------------ the checks themselves
def _src(**modules: str) -> dict[str, tuple[str, bool]]:
    return {name.replace("__", "."): (text, False) for name, text in modules.items()}


def test_a_second_public_class_is_caught_and_private_or_nested_ones_are_not():
    srcs = _src(megarl__a="class Actor:\n    class Inner: pass\nclass _Helper: pass\n",
                megarl__b="if True:\n    class Actor: pass\nclass _Helper: pass\ndef f():\n    class Inner: pass\n")
    assert duplicate_classes(srcs) == ["Actor: megarl.a:1, megarl.b:2"]


@pytest.mark.parametrize("source", [
    "from megarl.reshard.planner import _merge\n",
    "from .planner import _merge as merge\n",  # relative, renamed
    "def f():\n    from megarl.reshard.planner import plan, _merge\n",  # deferred
    "from megarl.platform import megatron_cpu_compat as compat\nx = compat._mode_active()\n",  # attribute
    "import megarl.platform.megatron_cpu_compat\nx = megarl.platform.megatron_cpu_compat._LOCK\n",
    "from megarl.trainer.rl_trainer import RLLoop\nRLLoop._scores(None)\n",  # a class's private method
    "from megarl.algorithms._vocab_parallel import all_reduce\n",  # a private module outside its package
])
def test_a_private_name_from_another_module_is_caught(source):
    found = private_uses({"megarl.reshard.fanout": (source, False)})
    assert len(found) == 1 and found[0].startswith("megarl.reshard.fanout:"), found


def test_own_private_names_and_a_private_module_in_its_package_pass():
    srcs = {
        "megarl.reshard.fanout": ("_X = 1\nclass A:\n    def f(self):\n        return self._y, _X\n"
                                  "from megarl.reshard.planner import plan_reshard\nimport torch\ntorch._C\n", False),
        "megarl.algorithms.entropy": ("from megarl.algorithms._vocab_parallel import all_reduce\n", False),
        "megarl.algorithms": ("from ._vocab_parallel import all_reduce\n", True),
    }
    assert private_uses(srcs) == []
