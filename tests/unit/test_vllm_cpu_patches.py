"""The vLLM compatibility patch that replaces the compiled log-prob rank count on CPU
(`megarl.rollout.vllm_adapter._eager_logprob_ranks`; the WORKAROUNDS row in megarl/platform/versions.py)."""

from __future__ import annotations

import numpy as np
import torch

from megarl.rollout.vllm_adapter import _eager_logprob_ranks, eager_count_greater_equal


def test_eager_count_is_the_rank_numpy_counts():
    """Rank of each row's value among the row (>=, ties counted), as vLLM defines it, against numpy."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen).round(decimals=1)  # rounding makes ties
    values = x[torch.arange(5), torch.tensor([0, 7, 299, 150, 3])][:, None]
    want = (x.numpy() >= values.numpy()).sum(-1)
    got = eager_count_greater_equal(x, values)
    assert got.dtype == torch.int64 and got.shape == (5,)
    np.testing.assert_array_equal(got.numpy(), want)
    assert (got >= 1).all()  # a value counts itself


def test_patch_reaches_the_sampler_that_calls_it():
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    _eager_logprob_ranks()
    _eager_logprob_ranks()  # idempotent
    # the sampler imported the name at its import: both bindings must be replaced, or the compiled one still runs
    assert sampler.batched_count_greater_than is eager_count_greater_equal
    assert logprobs.batched_count_greater_than is eager_count_greater_equal
