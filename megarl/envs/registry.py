"""The environment registry: `rollout.env` names a registered environment or a user file's factory.

An environment *factory* is `fn(**options) -> Environment`, called once per episode (an environment holds one
episode's state). `build_env_factory(spec, options)` resolves the spec once and returns the zero-argument callable
the rollout calls per episode:

    "calculator"                    a registered name (`register_env`; built-ins: calculator, search)
    "path/to/my_env.py:make_env"    `make_env` in a user Python file (imported once, like `reward.file`)

Errors are `ConfigError`s naming `rollout.env`, the spec and, for a file, the file and the factory.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

from megarl.config.errors import ConfigError, did_you_mean
from megarl.envs.base import Environment
from megarl.registry import Registry
from megarl.rewards.user import load_user_function

EnvFactory = Callable[..., Environment]

KEY = "rollout.env"
ENVS: Registry[EnvFactory] = Registry("environment", error=ConfigError, where=KEY,
                                      also="or give a user factory as 'path/to/file.py:function'")


def register_env(name: str, *, override: bool = False) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator: register the factory `fn(**options) -> Environment` under `name`. A taken name is an error
    unless `override=True`."""
    register = ENVS.register(name, override=override)

    def deco(fn: EnvFactory) -> EnvFactory:
        if ":" in name or name.endswith(".py"):
            raise ValueError(f"environment name {name!r} must not contain ':' or end in '.py' (file specs do)")
        return register(fn)

    return deco


def get_env(name: str) -> EnvFactory:
    """The factory registered as `name`; a ConfigError naming `rollout.env` lists the names."""
    return ENVS.get(name)


def list_envs() -> list[str]:
    return ENVS.names()


def load_env_file(path: str, function_name: str) -> EnvFactory:
    """Import `path` as a module and return its `function_name` (`megarl.rewards.user.load_user_function`, the
    `reward.file` loader). Errors are ConfigErrors naming `rollout.env`, the file and the function."""
    where = f"{KEY}={path}:{function_name}"
    try:
        return load_user_function(path, function_name, "environment file")
    except FileNotFoundError:
        raise ConfigError(f"{where}: file {path!r} does not exist") from None
    except AttributeError as e:
        public = e.candidates
        raise ConfigError(f"{where}: {path!r} defines no {function_name!r}{did_you_mean(function_name, public)}; "
                          f"its callables: {public}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: {function_name!r} is not callable ({str(e).rsplit('(', 1)[-1]}") from None
    except (ValueError, ImportError) as e:
        raise ConfigError(f"{where}: {e}") from e


def resolve_env(spec: str) -> EnvFactory:
    """The factory `spec` names: 'name' (registered) or 'path/to/file.py:function'."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{KEY} must be a registered environment name or 'path/to/file.py:function', got {spec!r}")
    if ":" in spec or spec.endswith(".py"):
        path, sep, function_name = spec.rpartition(":")
        if not sep or not path or not function_name or not path.endswith(".py"):
            raise ConfigError(f"{KEY}={spec!r}: a user environment is 'path/to/file.py:function' (the factory "
                              f"returning one episode's Environment)")
        return load_env_file(path, function_name)
    return get_env(spec)


def build_env_factory(spec: str, options: Optional[Mapping[str, Any]] = None) -> Callable[[], Environment]:
    """The per-episode constructor for `rollout.env=spec`: `factory()` returns a new Environment, built as
    `fn(**options)`. The options are checked against `fn`'s signature here, before any episode starts."""
    fn = resolve_env(spec)
    options = dict(options or {})
    try:
        inspect.signature(fn).bind(**options)
    except TypeError as e:
        raise ConfigError(f"{KEY}={spec!r}: options {sorted(options)} do not fit the factory's signature "
                          f"{fn.__name__}{inspect.signature(fn)}: {e}") from None
    except ValueError:  # no signature (a builtin): let the call decide
        pass

    def factory() -> Environment:
        return fn(**options)

    factory.spec = spec  # type: ignore[attr-defined]  (for logs and error messages)
    return factory
