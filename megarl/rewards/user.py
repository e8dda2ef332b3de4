"""User reward functions loaded from a Python file (`reward.file` + `reward.function`)."""

from __future__ import annotations

import importlib.util
import os
import sys

from megarl.rewards.registry import RewardFn


def load_reward_file(path: str, function_name: str) -> RewardFn:
    """Import `path` as a module and return its `function_name`, which must be callable as
    `fn(response_text, answer, record) -> float`. Errors name the file and the function."""
    return load_user_function(path, function_name, "reward file")


def load_user_function(path: str, function_name: str, what: str):
    """Import the Python file `path` (`what` names it in errors, e.g. "reward file") as a module and return its
    callable `function_name`. FileNotFoundError / ValueError (not a .py) / ImportError (it failed to import) /
    AttributeError (no such name; the file's callables listed, and in its `candidates`) / TypeError (not callable)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path!r} does not exist")
    if not path.endswith(".py"):
        raise ValueError(f"{what} {path!r} must be a Python file (.py)")
    module_name = f"megarl_user_{what.split()[0]}_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {what} {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses / pickling inside the user file need the module registered
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ImportError(f"{what} {path!r} failed to import: {type(e).__name__}: {e}") from e
    if not hasattr(module, function_name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        missing = AttributeError(f"{what} {path!r} defines no {function_name!r}; its callables: {public}")
        missing.candidates = public  # for callers that suggest a name
        raise missing
    fn = getattr(module, function_name)
    if not callable(fn):
        raise TypeError(f"{function_name!r} in {what} {path!r} is not callable (it is a {type(fn).__name__})")
    return fn
