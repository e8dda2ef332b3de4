"""Name -> function registries for the RL maths: advantage estimators, policy losses, KL estimators, aggregations.

Configs name an algorithm by string (``advantage: grpo``); the trainer looks it up here. A lookup of an unknown
name fails with the list of valid names, so a typo in a YAML file is caught at start-up, not mid-run.

    @register_advantage("grpo")
    def grpo(scores, group_ids, response_mask, ...): ...

    get_advantage("grpo")      # -> grpo
    get_advantage("gpro")      # UnknownNameError: unknown advantage estimator 'gpro'; valid: gae, grpo, ...

Every function in the package is registered when ``megarl.algorithms`` is imported (its ``__init__`` imports
all modules), so importing this module alone is enough for lookups to see them.
"""

from __future__ import annotations

import difflib
from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(KeyError, ValueError):
    """A registry lookup of a name that is not registered; the message lists the valid names.

    Subclasses both ``KeyError`` (it is a failed lookup) and ``ValueError`` (it is usually a bad config value).
    """

    def __str__(self) -> str:  # KeyError would repr() the message, quoting it
        return str(self.args[0])


class Registry:
    """A small name -> callable map for one kind of thing (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Callable] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator registering a function under ``name`` and any ``aliases``; duplicate names are an error."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._entries and self._entries[key] is not fn:
                    owner = self._entries[key].__qualname__
                    raise ValueError(f"{self.kind} {key!r} is already registered (by {owner})")
                self._entries[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> Callable:
        """The function registered as ``name``; ``UnknownNameError`` listing the valid names otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            valid = ", ".join(self.names())
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(f"unknown {self.kind} {name!r}{hint}; valid: {valid}") from None

    def names(self) -> list[str]:
        """All registered names (aliases included), sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
AGGREGATIONS = Registry("loss aggregation mode")

register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.get
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get
register_kl = KL_ESTIMATORS.register
get_kl = KL_ESTIMATORS.get
register_aggregation = AGGREGATIONS.register
get_aggregation = AGGREGATIONS.get
