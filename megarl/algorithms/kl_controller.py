"""KL-penalty coefficient controllers (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences").

``controller.value`` is the coefficient to pass to ``apply_kl_penalty``; after each step call
``controller.update(current_kl, n_steps)`` with the measured KL (nats) and the number of samples in the step.
"""

from __future__ import annotations

import torch


class FixedKLController:
    """A constant coefficient; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """No-op (kept so that both controllers are used the same way)."""

    def state_dict(self) -> dict:
        """{"value": the coefficient} (plain data, for a checkpoint)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the saved coefficient (a changed `kl.coef` is a config change the resume
        check refuses unless `checkpoint.allow_config_change`)."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target`` (nats).

    On ``update(current_kl, n_steps)``::

        proportional_error = clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value *= mult

    ``n_steps`` is the number of samples (responses) the KL was measured on; ``horizon`` is in the same unit
    (Ziegler et al. use 10,000 samples).
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if init_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs init_coef >= 0, target > 0, horizon > 0; got init_coef={init_coef}, "
                f"target={target}, horizon={horizon}"
            )
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        """Scale ``value`` by ``1 + clip(current_kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        """{"value": the current coefficient} (plain data, for a checkpoint); target and horizon come from the
        config."""
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`: the next `update` scales the saved coefficient."""
        self.value = float(state["value"])


def build_kl_controller(
    kind: str, coef: float, target: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """``"fixed"`` -> ``FixedKLController(coef)``; ``"adaptive"`` -> ``AdaptiveKLController(coef, target, horizon)``."""
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target is None or horizon is None:
            raise ValueError(f"adaptive KL controller needs target and horizon, got target={target}, horizon={horizon}")
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: adaptive, fixed")
