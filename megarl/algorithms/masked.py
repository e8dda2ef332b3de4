"""Masked reductions over ``[batch, response_len]`` tensors with a 0/1 ``response_mask``.

Masked-out positions never contribute to a statistic, whatever value they hold (even nan/inf are safe, since
they are selected away with ``torch.where`` rather than multiplied by 0).
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def _zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over all elements, or along ``dim``)."""
    zeroed = _zero_masked(values, mask)
    return zeroed.sum() if dim is None else zeroed.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1. An empty selection gives 0, not nan."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked elements (0-dim). ``unbiased`` divides by n-1 (Bessel); n <= 1 gives 0."""
    mean = masked_mean(values, mask)
    count = mask.to(values.dtype).sum()
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with masked mean and unbiased masked variance; masked positions 0.

    With ``shift_mean=False`` the mean is added back (only the scale is normalised).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_masked(whitened, mask)
