"""Name -> callable registries, and the did-you-mean every name lookup in megarl suggests with.

Configs name things that code registers: advantage estimators, policy losses, KL estimators and aggregation modes
(`megarl.algorithms.registry`), reward functions (`megarl.rewards.registry`), environments
(`megarl.envs.registry`) and tool-call parsers (`megarl.envs.tool_calls`). Each kind is one `Registry`:

    REWARDS = Registry("reward function", short="reward")
    register_reward = REWARDS.register          # @register_reward("gsm8k")
    REWARDS.get("gms8k")  # UnknownNameError: unknown reward function 'gms8k' (did you mean 'gsm8k'?); valid: ...

A failed lookup names what was asked, the closest registered name and all of them, so a typo in a YAML file is
caught at start-up with its fix. The module imports nothing of megarl: it is the lowest layer
(tests/unit/test_layering.py), for every layer that registers names to use.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """" (did you mean '<prefix><x>'?)" for the candidate closest to `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


class UnknownNameError(KeyError, ValueError):
    """A registry lookup of a name that is not registered; the message lists the valid names.

    Subclasses both ``KeyError`` (it is a failed lookup) and ``ValueError`` (it is usually a bad config value).
    """

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it
        return str(self.args[0])


class Registry(Generic[F]):
    """Named callables of one kind.

    kind: what an entry is, in lookup errors ("unknown <kind> 'x'"). short: the same in registration errors
        ("<short> 'x' is already registered"); defaults to `kind`.
    error: the exception a failed lookup raises (`UnknownNameError`; `ConfigError` where the name comes straight
        from one config key). where: that config key, prefixed to lookup errors ("rollout.env: unknown ...").
        also: what else the key accepts, appended to lookup errors.
    """

    def __init__(self, kind: str, *, short: str | None = None, error: type[Exception] = UnknownNameError,
                 where: str = "", also: str = "") -> None:
        self.kind = kind
        self.short = short or kind
        self.error = error
        self.where = where
        self.also = also
        self._entries: dict[str, F] = {}

    def register(self, name: str, *aliases: str, override: bool = False) -> Callable[[F], F]:
        """Decorator: register `fn` under `name` and any `aliases`. A name taken by another object is an error
        unless `override=True` (registering the same object again is allowed)."""

        def deco(fn: F) -> F:
            if not callable(fn):
                raise TypeError(f"{self.short} {name!r}: {fn!r} is not callable")
            for key in (name, *aliases):
                taken = self._entries.get(key)
                if taken is not None and taken is not fn and not override:
                    owner = getattr(taken, "__qualname__", repr(taken))
                    raise ValueError(f"{self.short} {key!r} is already registered (pass override=True to replace "
                                     f"{owner})")
                self._entries[key] = fn
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Forget `name` (a no-op when it is not registered): for tests that register a temporary entry."""
        self._entries.pop(name, None)

    def get(self, name: str) -> F:
        """The entry registered as `name`; else `error` naming `name`, the closest registered name and all of them."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name from a config
            where = f"{self.where}: " if self.where else ""
            also = f"; {self.also}" if self.also else ""
            raise self.error(f"{where}unknown {self.kind} {name!r}{did_you_mean(str(name), self._entries)}; "
                             f"valid: {', '.join(self.names())}{also}") from None

    def names(self) -> list[str]:
        """All registered names (aliases included), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
