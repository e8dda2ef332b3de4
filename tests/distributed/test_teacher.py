"""Distillation teachers (`megarl.roles.teacher.build_teacher`) on real megatron-core over gloo (4 CPU ranks, fp32):
a teacher's log-probs of given token ids equal transformers' log-softmax of the same HF model on the same ids, at
teacher TP=2 (ranks 0-1) and PP=2 (ranks 2-3) loaded from the HF directory, and at PP=2 loaded from a megarl Megatron
checkpoint of the TP=2 teacher (the other form `distillation.teachers.<name>.path` takes); and the worker-side call
the trainer makes (`RoleHost.compute_teacher_log_probs` on each rank's DP share, teacher TP2 x DP2, offloaded after).

One spawn of 4 ranks for all three (its own: test_roles' spawn builds its roles from one fixed HF model and runs ~10
phases; adding the teacher's there would tie two unrelated files' failures together). Measured: 11-13 s.

Tolerance: max |megatron - transformers| over the response tokens, measured on this model (2 layers, vocab 300, logits
up to ~5, eager fp32, printed with -s): TP2 9.5e-7, PP2 9.5e-7, PP2 from the checkpoint 9.5e-7 (fp32 summation order
only); ATOL = 1e-5 is 10x that and still far below a layout mistake (a wrong TP shard or a missing layer moves
log-probs by > 0.1).
"""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import padded_random_batch

ATOL = 1e-5  # see the module docstring: measured float32 error 9.5e-7
B, S = 4, 16
PROMPT = [3, 5, 2, 4]
RESPONSE = [9, 6, 12, 8]


def _batch(vocab: int):
    """[B, S] right-padded token ids (pad 0), attention and response masks, the same in every process."""
    return padded_random_batch(PROMPT, RESPONSE, S, vocab, seed=17)


def _worker(rank: int, world: int, hf_dir: str, ckpt_dir: str):
    from megarl.checkpoint.dist_ckpt import save_engine_checkpoint
    from megarl.config.schema import ParallelConfig, TeacherConfig
    from megarl.roles.teacher import build_teacher

    batch = _batch(300)
    out: dict = {}

    def teacher(name, path, parallel, rank_offset):
        t = TeacherConfig(path=path, parallel=parallel, micro_batch_samples=2)
        role = build_teacher(t, dtype="fp32", seed=1, samples_per_prompt=1, rank_offset=rank_offset)
        if role is not None:
            lp = role.compute_log_probs(batch, with_entropy=False)
            if lp is not None:  # the last pipeline stage
                out[name] = lp["log_probs"].clone()
        return role

    tp2 = teacher("tp2", hf_dir, ParallelConfig(tp=2, dp=1), 0)
    teacher("pp2", hf_dir, ParallelConfig(pp=2, dp=1), 2)
    save_engine_checkpoint(None if tp2 is None else tp2.engine, ckpt_dir, hf_dir=hf_dir)
    teacher("pp2_from_megatron_checkpoint", ckpt_dir, ParallelConfig(pp=2, dp=1), 0)
    out["host"] = _host_shares(hf_dir, batch)
    return out


def _host_shares(hf_dir: str, batch) -> dict:
    """The worker-side path the trainer calls: a `RoleHost` on the actor's pool (all 4 ranks) built from a validated
    job config with one teacher at TP2 x DP2 (offloaded while idle); this rank's DP share of the batch (as the
    controller's DP_SPLIT cuts it) through `compute_teacher_log_probs`. Returns (rows, log-probs, offload events)."""
    from megarl.config.loader import parse_config
    from megarl.config.validate import validate
    from megarl.controller.dispatch import SPLIT_ROWS_META, chunk_bounds
    from megarl.workers.role_host import RoleHost

    cfg = validate(parse_config({
        "model": {"path": hf_dir, "dtype": "fp32"},
        "resources": {"device": "cpu", "pools": {"default": {"devices_per_node": 4}}},
        "actor": {"parallel": {"tp": 2}},
        "rollout": {"tp": 2, "samples_per_prompt": 2, "max_prompt_tokens": 16, "max_new_tokens": 16},
        "data": {"train_path": "unused.jsonl", "prompts_per_step": 2},
        "trainer": {"total_steps": 1},
        "distillation": {"teachers": {"t": {"path": hf_dir, "parallel": {"tp": 2},
                                            "offload": {"params": True}}}},
    }))
    host = RoleHost(cfg, ["actor"], pool="default")
    dp_rank, dp = host.teacher_dp()
    lo, hi = chunk_bounds(len(batch), dp, dp_rank)
    share = batch.slice(lo, hi)
    share.meta[SPLIT_ROWS_META] = (lo, hi)
    got = host.compute_teacher_log_probs(share, teacher="t", fetch=("log_probs",))
    return {"rows": (lo, hi), "log_probs": got.tensors["log_probs"].clone(),
            "events": [e for e in host.events if e[1] == "teacher/t"]}


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    from tests.distributed.harness import tiny_family_dir

    root = tmp_path_factory.mktemp("teacher")
    hf_dir = tiny_family_dir(str(root / "hf"), "llama", seed=7)
    per_rank = run_ranks(4, _worker, hf_dir, str(root / "ckpt"), timeout_s=600)
    return hf_dir, str(root / "ckpt"), per_rank


def _transformers_log_probs(hf_dir: str) -> torch.Tensor:
    """transformers' (eager, fp32) log-softmax of each response token of `_batch`, token-aligned [B, S], 0 off it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    lp = torch.log_softmax(logits, -1)
    want = torch.zeros(B, S)
    want[:, 1:] = lp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return want * batch["response_mask"]


@pytest.mark.parametrize("layout, ranks", [("tp2", [0, 1]), ("pp2", [3]), ("pp2_from_megatron_checkpoint", [1])])
def test_teacher_log_probs_equal_transformers(teachers, layout, ranks):
    """Every last-stage rank of the layout (both TP ranks; the second pipeline stage) returns transformers' log-probs
    of the sampled tokens within ATOL (the measured fp32 error x 10), and only those ranks return any."""
    hf_dir, _, per_rank = teachers
    assert [r for r, got in enumerate(per_rank) if layout in got] == ranks
    want = _transformers_log_probs(hf_dir)
    assert want.abs().max() > 1.0  # a real comparison: the log-probs are far from 0
    for r in ranks:
        got = per_rank[r][layout]
        err = (got - want).abs().max().item()
        print(f"{layout} rank {r}: max |megatron - transformers| = {err:.2e}")
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_the_role_host_scores_its_dp_share_with_the_teacher_and_offloads_it(teachers):
    """`RoleHost.compute_teacher_log_probs` on each rank's DP share (teacher TP2 x DP2 on a 4-rank pool): the shares'
    rows cover the batch once, each equals transformers' rows within ATOL, and the teacher went to host memory
    after its forward (`offload.params`)."""
    hf_dir, _, per_rank = teachers
    want = _transformers_log_probs(hf_dir)
    rows = sorted({r["host"]["rows"] for r in per_rank})
    assert rows == [(0, 2), (2, 4)]
    for r in per_rank:
        lo, hi = r["host"]["rows"]
        torch.testing.assert_close(r["host"]["log_probs"], want[lo:hi], atol=ATOL, rtol=0)
        assert r["host"]["events"] and "params" in r["host"]["events"][-1][2]


def test_a_megatron_checkpoint_teacher_brings_its_tokenizer(teachers):
    """The checkpoint keeps the HF directory's tokenizer (hf_assets/): the start-up tokenizer check reads it there
    and finds it identical to the HF directory's."""
    from transformers import AutoTokenizer

    from megarl.data.tokenizer_match import teacher_tokenizer_dir, tokenizer_difference

    hf_dir, ckpt, _ = teachers
    assert teacher_tokenizer_dir(ckpt) != ckpt
    from_ckpt = AutoTokenizer.from_pretrained(teacher_tokenizer_dir(ckpt))
    assert tokenizer_difference(AutoTokenizer.from_pretrained(hf_dir), from_ckpt) is None
