"""YAML <-> `JobConfig`: parsing, dotted `key=value` overrides, type coercion by annotation, dumping.

Values are coerced by the field's annotation: int, float, bool, str, Optional[X], Literal[...], tuple[X, ...]
(lists), tuple[X, Y], dict[str, X] and nested dataclasses. Every error is a `ConfigError` whose message starts
with the dotted key path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from typing import Any, Iterable, Literal, Mapping, Union

import yaml

from megarl.config.errors import ConfigError, did_you_mean
from megarl.config.schema import JobConfig

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NULL = {"null", "none", "~", ""}


@dataclasses.dataclass(frozen=True)
class _Override:
    """A value given on the command line: the raw text and its YAML reading (coerced once the type is known)."""

    raw: str
    parsed: Any


# --------------------------------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | os.PathLike) -> dict:
    """The top-level mapping of a YAML file; malformed YAML raises ConfigError with the line and column."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) from None
    if data is None:
        raise ConfigError(f"{path}: the config file is empty")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[list[str], _Override]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value). The value is YAML (lists, numbers, null) but kept raw too."""
    if "=" not in text:
        raise ConfigError(f"malformed override {text!r}: no '=' (expected key=value, e.g. actor.parallel.tp=2)")
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"malformed override {text!r}: empty key (expected key=value, e.g. actor.parallel.tp=2)")
    try:
        parsed = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        parsed = raw
    return parts, _Override(raw=raw, parsed=parsed)


def apply_overrides(data: Mapping, overrides: Iterable[str]) -> dict:
    """A copy of `data` with each dotted override set (intermediate mappings are created as needed)."""
    out = _copy_tree(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"cannot set '{'.'.join(parts)}': '{where}' is {child!r}, not a section")
            node = child
        node[parts[-1]] = value
    return out


def _copy_tree(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _copy_tree(v) for k, v in data.items()}
    return data


# --------------------------------------------------------------------------------------------------- coercion


@functools.lru_cache(maxsize=None)
def type_hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, cached per config class: {field: its resolved type}."""
    return typing.get_type_hints(cls)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def type_name(tp: Any) -> str:
    """Human name of an annotation: 'int', 'int or null', "one of 'a', 'b'", 'list of str', ..."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + (" or null" if len(rest) < len(args) else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of ({type_name(args[0])})" if typing.get_origin(args[0]) else f"list of {type_name(args[0])}"
        return f"list of {len(args)} ({', '.join(type_name(a) for a in args)})"
    if origin is dict:
        return f"mapping of name -> {type_name(args[1])}"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _wrong(path: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")


def _is_str_type(tp: Any) -> bool:
    if tp is str:
        return True
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_is_str_type(a) for a in typing.get_args(tp))
    return False


def coerce(tp: Any, value: Any, path: str) -> Any:
    """`value` converted to annotation `tp`, or ConfigError naming `path`."""
    if isinstance(value, _Override):
        if _is_str_type(tp) and not (value.parsed is None and value.raw.strip().lower() in _NULL):
            value = value.parsed if isinstance(value.parsed, str) else value.raw.strip()
        else:
            value = value.parsed
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if value is None:
            raise _wrong(path, tp, value)
        if len(rest) != 1:
            raise TypeError(f"unsupported union annotation {tp} at {path}")
        return coerce(rest[0], value, path)
    if origin is Literal:
        if isinstance(value, (bool, int, float, str)) and value in args and type(value) in {type(a) for a in args}:
            return value
        if isinstance(value, bool) and str(value).lower() in args:  # YAML reads `false` as a bool; the choice is text
            return str(value).lower()
        hint = did_you_mean(str(value), [str(a) for a in args]) if isinstance(value, str) else ""
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}{hint}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis and value is not None and not isinstance(value, dict):
                value = [value]  # a single value is a one-element list
            else:
                raise _wrong(path, tp, value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {type_name(tp)}, got {len(value)} values {list(value)!r}")
        return tuple(coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _wrong(path, tp, value)
        key_tp, val_tp = args
        out = {}
        for k, v in value.items():
            if not isinstance(k, key_tp):
                raise ConfigError(f"{_join(path, k)}: expected a {type_name(key_tp)} key, got {k!r}")
            out[k] = coerce(val_tp, v, _join(path, k))
        return out
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise _wrong(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _wrong(path, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads 1e-6 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _wrong(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong(path, tp, value)
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping: unknown keys, wrong types and missing keys raise ConfigError."""
    if isinstance(data, _Override):
        data = data.parsed
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping (section), got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = _join(path, key)
            # compare the last component only: the shared prefix would make every key look close
            hint = did_you_mean(str(key), fields, prefix=f"{path}." if path else "")
            if not hint:
                hint = f" (valid keys{' under ' + repr(path) if path else ''}: {', '.join(fields)})"
            raise ConfigError(f"unknown key '{full}'{hint}")
    hints = type_hints(cls)
    values = {}
    for name, f in fields.items():
        p = _join(path, name)
        if name in data:
            value = coerce(hints[name], data[name], p)
        elif f.default is not dataclasses.MISSING:
            continue
        elif f.default_factory is not dataclasses.MISSING:
            continue
        elif dataclasses.is_dataclass(hints[name]):
            value = from_dict(hints[name], {}, p)  # names the first missing key inside the section
        else:
            raise ConfigError(f"missing required key '{p}': {f.metadata.get('help', '')}")
        lo = f.metadata.get("min")
        if lo is not None and isinstance(value, (int, float)) and not isinstance(value, bool) and value < lo:
            raise ConfigError(f"{p}: must be >= {lo}, got {value}")
        values[name] = value
    return cls(**values)


# --------------------------------------------------------------------------------------------------- dumping


def to_dict(cfg: Any) -> Any:
    """Plain YAML-ready data (dicts, lists, scalars) of a config; `from_dict` reads it back to an equal config."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_yaml(cfg: Any) -> str:
    """YAML text of a config (section order as declared)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)


# --------------------------------------------------------------------------------------------------- entry points


def parse_config(data: Mapping, overrides: Iterable[str] = ()) -> JobConfig:
    """Mapping + overrides -> typed `JobConfig`, without the cross-field rules."""
    return from_dict(JobConfig, apply_overrides(data, overrides))


def load_config(path: str | os.PathLike, overrides: Iterable[str] = ()) -> JobConfig:
    """Read, override, type-check and validate a job config; returns the resolved config (dp, micro-batches,
    advantage estimator filled in). Raises ConfigError with the key path on any problem.
    """
    from megarl.config.validate import validate  # validate imports this module's helpers

    return validate(parse_config(read_yaml(path), overrides))
