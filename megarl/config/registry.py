"""A name -> object registry whose lookup errors name what was asked, the known names and the closest one.

The config names things that code registers (reward functions, environments, tool-call parsers); each such kind
keeps one `Registry`:

    REWARDS = Registry("reward function", short="reward")
    register_reward = REWARDS.register          # @register_reward("gsm8k")
    REWARDS.get("gms8k")  # KeyError: unknown reward function 'gms8k' (did you mean 'gsm8k'?); registered: [...]

It lives beside `did_you_mean` in config (below rewards and envs) so that every layer that registers names can use
it.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from megarl.config.errors import did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    """Named callables of one kind.

    kind: what an entry is, in lookup errors ("unknown <kind> 'x'"). short: the same in registration errors
        ("<short> 'x' is already registered"); defaults to `kind`.
    error: the exception type a failed lookup raises (KeyError; ConfigError where the name comes straight from a
        config key). where: the config key the name came from, prefixed to lookup errors ("rollout.env: unknown
        ..."). also: a sentence appended to lookup errors (what else the key accepts).
    """

    def __init__(self, kind: str, *, short: str | None = None, error: type[Exception] = KeyError, where: str = "",
                 also: str = "") -> None:
        self.kind = kind
        self.short = short or kind
        self.error = error
        self.where = where
        self.also = also
        self._entries: dict[str, T] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[T], T]:
        """Decorator: register `fn` under `name`. A taken name is an error unless `override=True` (registering the
        same object again is allowed; one object may be registered under several names)."""

        def deco(fn: T) -> T:
            if not callable(fn):
                raise TypeError(f"{self.short} {name!r}: {fn!r} is not callable")
            if name in self._entries and not override and self._entries[name] is not fn:
                raise ValueError(f"{self.short} {name!r} is already registered (pass override=True to replace it)")
            self._entries[name] = fn
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Forget `name` (a no-op when it is not registered): for tests that register a temporary entry."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as `name`; else `error` naming `name`, the closest registered name and all of them."""
        try:
            return self._entries[name]
        except KeyError:
            where = f"{self.where}: " if self.where else ""
            also = f"; {self.also}" if self.also else ""
            raise self.error(f"{where}unknown {self.kind} {name!r}{did_you_mean(name, self._entries)}; registered: "
                             f"{self.names()}{also}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
