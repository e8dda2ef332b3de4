"""Distillation teachers (`megarl.roles.teacher.build_teacher`) on real megatron-core over gloo (4 CPU ranks, fp32):
a teacher's log-probs of given token ids equal transformers' log-softmax of the same HF model on the same ids, at
teacher TP=2 (ranks 0-1) and PP=2 (ranks 2-3) loaded from the HF directory, and at PP=2 loaded from a megarl Megatron
checkpoint of the TP=2 teacher (the other form `distillation.teachers.<name>.path` takes); and the worker-side call
the trainer makes (`RoleHost.compute_teacher_log_probs` on each rank's DP share, teacher TP2 x DP2, offloaded after).
The top-k forward KL (distillation.top_k): the teacher's top-k distribution equals transformers' at TP2, PP2 and CP2
(the CP2 teacher's sampled-token log-probs too), and a student's update with that term alone, at TP2 and at CP2,
reports transformers' dense value of the term and takes an Adam step along its dense gradient.

One spawn of 4 ranks for all of it (its own: test_roles' spawn builds its roles from one fixed HF model and runs ~10
phases; adding the teacher's there would tie two unrelated files' failures together). Measured: 11-13 s without the
top-k part, 21 s with it.

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
TOP_K = 5  # the teacher's top-k distribution (distillation.top_k)
STUDENT_LR = 1e-3
PROMPT = [3, 5, 2, 4]
RESPONSE = [9, 6, 12, 8]


def _batch(vocab: int):
    """[B, S] right-padded token ids (pad 0), attention and response masks, the same in every process."""
    return padded_random_batch(PROMPT, RESPONSE, S, vocab, seed=17)


def _worker(rank: int, world: int, hf_dir: str, ckpt_dir: str, student_dir: str, student_ckpt: str):
    from megarl.checkpoint.dist_ckpt import save_engine_checkpoint
    from megarl.config.schema import ParallelConfig, TeacherConfig
    from megarl.roles.teacher import build_teacher

    batch = _batch(300)
    out: dict = {}

    def teacher(name, path, parallel, rank_offset):
        t = TeacherConfig(path=path, parallel=parallel, micro_batch_samples=2)
        role = build_teacher(t, dtype="fp32", seed=1, samples_per_prompt=1, rank_offset=rank_offset)
        if role is not None:
            lp = role.compute_log_probs(batch, with_entropy=False, top_k=TOP_K)
            if lp is not None:  # the last pipeline stage
                out[name] = lp["log_probs"].clone()
                out[f"{name}/top_k"] = (lp["top_k_ids"].clone(), lp["top_k_log_probs"].clone())
        return role

    tp2 = teacher("tp2", hf_dir, ParallelConfig(tp=2, dp=1), 0)
    teacher("pp2", hf_dir, ParallelConfig(pp=2, dp=1), 2)
    save_engine_checkpoint(None if tp2 is None else tp2.engine, ckpt_dir, hf_dir=hf_dir)
    teacher("pp2_from_megatron_checkpoint", ckpt_dir, ParallelConfig(pp=2, dp=1), 0)
    teacher("cp2", hf_dir, ParallelConfig(cp=2, dp=1), 2)
    out["host"] = _host_shares(hf_dir, batch)
    out.update(_students(batch, out, student_dir, student_ckpt))
    return out


def _students(batch, teacher_out: dict, student_dir: str, student_ckpt: str) -> dict:
    """The student's top-k forward KL term (`PolicyLossSettings.top_k_kl_coef`) in one real update: a student (another
    random model) at TP2 (ranks 0-1, fed the TP2 teacher's top-k) and at CP2 (ranks 2-3, fed the CP2 teacher's),
    advantages 0 so the loss is that term alone, one Adam step (lr 1e-3, no clipping or decay). Returns this rank's
    update metric `student_<layout>` (the term's token mean before the step) and saves each student's weights after
    the step (an HF directory at `student_ckpt`-<layout>-hf through a Megatron checkpoint, collective)."""
    from megarl.checkpoint.dist_ckpt import megatron_to_hf, save_engine_checkpoint
    from megarl.engine import OptimizerSettings
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.roles.actor import Actor, PolicyLossSettings
    from megarl.roles.base import BatchingSettings

    out = {}
    for layout, topo in (("tp2", RoleTopology(tp=2)), ("cp2", RoleTopology(cp=2, rank_offset=2))):
        groups = build_role_groups(topo)
        actor = None
        if groups.is_member:
            actor = Actor(ModelSpec.from_hf_dir(student_dir), groups, hf_dir=student_dir,
                          optimizer=OptimizerSettings(name="adam", lr=STUDENT_LR, clip_grad=0.0),
                          batching=BatchingSettings(micro_batch_samples=2), loss=PolicyLossSettings(top_k_kl_coef=1.0))
            ids, logp = teacher_out[f"{layout}/top_k"]
            zeros = torch.zeros(B, S)
            b = batch.update({"teacher_top_k_ids": ids, "teacher_top_k_log_probs": logp, "old_log_probs": zeros,
                              "advantages": zeros})
            out[f"student_{layout}"] = actor.update(b)["distill_top_k_kl"]
        save_engine_checkpoint(None if actor is None else actor.engine, f"{student_ckpt}-{layout}",
                               hf_dir=student_dir)
        megatron_to_hf(f"{student_ckpt}-{layout}", f"{student_ckpt}-{layout}-hf")
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
    student_dir = tiny_family_dir(str(root / "student"), "llama", seed=8)
    per_rank = run_ranks(4, _worker, hf_dir, str(root / "ckpt"), student_dir, str(root / "student_ckpt"),
                         timeout_s=600)
    return hf_dir, str(root / "ckpt"), per_rank, student_dir, str(root / "student_ckpt")


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
    hf_dir, _, per_rank, *_ = teachers
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
    hf_dir, _, per_rank, *_ = teachers
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

    hf_dir, ckpt, *_ = teachers
    assert teacher_tokenizer_dir(ckpt) != ckpt
    from_ckpt = AutoTokenizer.from_pretrained(teacher_tokenizer_dir(ckpt))
    assert tokenizer_difference(AutoTokenizer.from_pretrained(hf_dir), from_ckpt) is None


# --------------------------------------------------------------------------------------------------- top-k forward KL


def _transformers_logits(hf_dir: str) -> tuple:
    """(model, logits [B, S, V] float32 of `_batch`): transformers, eager fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    batch = _batch(model.config.vocab_size)
    return model, model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()


def _transformers_top_k(hf_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-TOP_K next-token distribution at each response token, token-aligned (row t from the logits
    at t - 1): (ids [B, S, k], log-probs [B, S, k]), 0 off the response."""
    with torch.no_grad():
        _, logits = _transformers_logits(hf_dir)
    top, ids = torch.log_softmax(logits, -1)[:, :-1].topk(TOP_K, -1)
    keep = _batch(300)["response_mask"][:, 1:, None]
    pad = (0, 0, 1, 0)
    return torch.nn.functional.pad(ids * keep, pad), torch.nn.functional.pad(top * keep, pad)


@pytest.mark.parametrize("layout, ranks", [("tp2", [0, 1]), ("pp2", [3]), ("cp2", [2, 3])])
def test_teacher_top_k_equals_transformers(teachers, layout, ranks):
    """The teacher's top-k distribution (`compute_log_probs(top_k=5)`, vocab-parallel at TP2, on the last stage at
    PP2, from the CP-gathered sequence at CP2) on every last-stage rank: transformers' top-5 ids, and their
    log-probs within ATOL; its sampled-token log-probs at CP2 equal transformers' too."""
    hf_dir, _, per_rank, *_ = teachers
    want_ids, want_logp = _transformers_top_k(hf_dir)
    mask = _batch(300)["response_mask"].bool()
    assert [r for r, got in enumerate(per_rank) if f"{layout}/top_k" in got] == ranks
    for r in ranks:
        ids, logp = per_rank[r][f"{layout}/top_k"]
        assert ids.dtype == torch.int64 and ids.shape == (B, S, TOP_K)
        assert torch.equal(ids[mask], want_ids[mask]) and not ids[~mask].any()
        torch.testing.assert_close(logp, want_logp, atol=ATOL, rtol=0)
    if layout == "cp2":
        for r in ranks:
            torch.testing.assert_close(per_rank[r]["cp2"], _transformers_log_probs(hf_dir), atol=ATOL, rtol=0)


def _dense_student_loss(hf_dir: str, student_dir: str):
    """The term computed densely by transformers: mean over the response tokens of sum over the teacher's top-5 of
    p_T (log p_T - log p_S), from the full-vocabulary log-softmax of each model; returns (value, the student
    model whose .grad holds the term's gradient)."""
    ids, t_logp = _transformers_top_k(hf_dir)
    student, logits = _transformers_logits(student_dir)
    s_logp = torch.nn.functional.pad(torch.log_softmax(logits, -1)[:, :-1], (0, 0, 1, 0)).gather(-1, ids)
    mask = _batch(300)["response_mask"].float()
    per_token = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach()), student


@pytest.mark.parametrize("layout, ranks", [("tp2", [0, 1]), ("cp2", [2, 3])])
def test_the_students_top_k_forward_kl_and_its_step_follow_the_dense_computation(teachers, layout, ranks):
    """The student's update with the top-k forward KL alone (TP2: vocab-parallel loss; CP2: the teacher's top-k
    over the whole sequence against the CP-gathered logits): its term equals transformers' dense value within ATOL,
    and the one Adam step (first step: -lr * g / (|g| + eps), about -lr * sign(g)) moved every weight whose dense
    gradient is not negligible against that gradient's sign (the weights after the step read back through
    megatron_to_hf)."""
    from transformers import AutoModelForCausalLM

    hf_dir, _, per_rank, student_dir, student_ckpt = teachers
    want, dense = _dense_student_loss(hf_dir, student_dir)
    assert want > 0.1  # a real comparison: teacher and student differ
    for r in ranks:
        assert abs(per_rank[r][f"student_{layout}"] - want) < ATOL, (per_rank[r][f"student_{layout}"], want)
    after = dict(AutoModelForCausalLM.from_pretrained(f"{student_ckpt}-{layout}-hf",
                                                      dtype=torch.float32).named_parameters())
    checked = 0
    for name, p in dense.named_parameters():
        g = p.grad
        big = g.abs() > 1e-3 * g.abs().max()
        moved = (after[name].detach() - p.detach())[big]
        assert torch.equal(torch.sign(moved), -torch.sign(g[big])), name
        assert (moved.abs() - STUDENT_LR).abs().max() < 0.05 * STUDENT_LR, name
        checked += int(big.sum())
    assert checked > 1000
