"""DAPO's treatment of overlong responses (Yu et al. 2025, section 3.4): filtering and soft punishment.

A response that hit the generation limit (finish_reason 'length') was cut, not finished: its reward says little
about the answer it would have given.

- Overlong filtering: truncated responses leave the policy loss (their tokens are masked out, numerator and
  normaliser alike); they still count in their group's reward statistics (the advantages are computed first).
- Soft overlong punishment (DAPO eq. 13), added to the reward of a response of ``|y|`` tokens::

      R_length(y) = 0                                    if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                  = -1                                   if |y| > L_max

  a linear ramp from 0 to -1 over the last ``L_cache`` tokens before the limit ``L_max`` (the paper: L_max =
  20480 generated tokens, L_cache = 4096), scaled here by ``factor`` (1 in the paper).
"""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's R_length (module docstring) times ``factor``.

    Args: lengths [B] response lengths in tokens (any numeric dtype); max_len: L_max, tokens (the generation limit,
        ``rollout.max_new_tokens``); cache_len: L_cache, tokens, 1 <= cache_len <= max_len; factor: scale (>= 0).
    Returns: [B] float32, in [-factor, 0]; add it to the sequence scores.
    """
    if not 1 <= cache_len <= max_len:
        raise ValueError(f"need 1 <= cache_len <= max_len (tokens), got cache_len={cache_len}, max_len={max_len}")
    if factor < 0:
        raise ValueError(f"factor must be >= 0, got {factor}")
    n = lengths.to(torch.float32)
    start = float(max_len - cache_len)
    ramp = (start - n) / float(cache_len)
    penalty = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_len, ramp, torch.full_like(n, -1.0)))
    return penalty * factor


def filter_truncated(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``response_mask`` [B, T] (the loss mask, gaps allowed) with the rows of truncated responses (``truncated``
    [B] bool) zeroed (same dtype): the loss mask of DAPO's overlong filtering."""
    if truncated.dim() != 1 or truncated.shape[0] != response_mask.shape[0]:
        raise ValueError(f"truncated must be [B] = [{response_mask.shape[0]}], got {tuple(truncated.shape)}")
    return response_mask * (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)
