"""Shared pieces of the multi-rank tests: a tiny HF model, the next-token loss, grouping per-rank results."""

from __future__ import annotations

import torch


def group_by_case(per_rank: list[dict]) -> dict[str, list]:
    """[{case: result} per rank] -> {case: [result of each rank that ran it, in rank order]}."""
    by_case: dict[str, list] = {}
    for rank_result in per_rank:
        for name, result in rank_result.items():
            by_case.setdefault(name, []).append(result)
    return by_case


def tiny_qwen2_dir(tmp_path_factory) -> str:
    """A random untied Qwen2 (qkv bias, GQA, vocab 300 so both sides pad it) saved as an HF directory."""
    from megarl.checkpoint.tiny import make_hf_model

    return make_hf_model("qwen2", str(tmp_path_factory.mktemp("hf") / "qwen2"), tie_word_embeddings=False,
                         hidden_size=128, intermediate_size=256)


def next_token_ce_loss(engine):
    """`MegatronEngine.run` loss: next-token cross-entropy summed over tokens, units = tokens (exact token mean)."""
    from megarl.algorithms.log_probs import vocab_parallel_log_probs

    vocab_start, _ = engine.vocab_shard()

    def loss_fn(logits, batch):
        tokens = batch["input_ids"]
        logp = vocab_parallel_log_probs(logits[:, :-1], tokens[:, 1:], engine.groups.pgs.tp, vocab_start)
        loss_sum = -logp.sum()
        units = torch.tensor(logp.numel(), dtype=torch.int)
        return loss_sum, units, {"loss_sum": loss_sum.detach().clone(), "units": units.clone()}

    return loss_fn
