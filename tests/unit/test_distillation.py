"""On-policy distillation without workers: the per-token reverse-KL advantage and its metric (hand-computed
values), teacher routing by data source, the `distillation:` config section (resolution and refusals, each naming
the key) and the start-up refusal of a teacher whose tokenizer is not the student's."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART_TOKENIZER = ROOT / "data" / "quickstart" / "tokenizer"

# two rows of four positions; the loss mask covers row 0's positions 1-2 and row 1's positions 1-3
MASK = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]])
TEACHER = torch.tensor([[-9.0, -1.0, -0.5, -9.0], [-9.0, -2.0, -0.25, -3.0]])
STUDENT = torch.tensor([[-7.0, -1.5, -0.5, -7.0], [-7.0, -1.0, -0.75, -1.0]])


def test_reverse_kl_advantage_is_coef_times_teacher_minus_student_on_the_mask_only():
    from megarl.algorithms.distillation import reverse_kl_advantages

    got = reverse_kl_advantages(TEACHER, STUDENT, MASK, coef=2.0)
    # by hand: 2 * (teacher - student) where the mask is 1: row 0 -> 2*0.5, 2*0; row 1 -> 2*-1, 2*0.5, 2*-2
    want = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, -2.0, 1.0, -4.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reverse_kl_mean_is_student_minus_teacher_over_the_masked_tokens():
    from megarl.algorithms.distillation import reverse_kl_mean

    # (student - teacher) on the 5 masked tokens: -0.5, 0, 1, -0.5, 2 -> mean 0.4 (the unmasked -9/-7 are ignored)
    assert math.isclose(reverse_kl_mean(TEACHER, STUDENT, MASK), 0.4, rel_tol=1e-6)
    assert reverse_kl_mean(TEACHER, STUDENT, torch.zeros_like(MASK)) == 0.0


def test_task_advantage_is_added_with_its_weight():
    from megarl.algorithms.distillation import combine_advantages

    distill, task = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 0.5]])
    torch.testing.assert_close(combine_advantages(distill, task, 0.0), distill)
    torch.testing.assert_close(combine_advantages(distill, task, 2.0), torch.tensor([[2.0, -1.0]]))


def test_shapes_that_differ_are_refused():
    from megarl.algorithms.distillation import reverse_kl_advantages

    with pytest.raises(ValueError, match=r"one shape \[B, S\]"):
        reverse_kl_advantages(TEACHER[:, :3], STUDENT, MASK, 1.0)


def test_rows_go_to_the_teacher_of_their_data_source_and_the_rest_to_the_default_one():
    from megarl.algorithms.distillation import rows_by_source

    rows = rows_by_source(["math", "code", None, "math", "chat"], {"m": "math", "c": "code", "any": None})
    assert rows["m"].tolist() == [True, False, False, True, False]
    assert rows["c"].tolist() == [False, True, False, False, False]
    assert rows["any"].tolist() == [False, False, True, False, True]
    with pytest.raises(ValueError, match=r"sample 1 has data source 'code', which no teacher scores"):
        rows_by_source(["math", "code"], {"m": "math"})


def test_the_loop_forms_the_advantage_from_each_rows_teacher_and_logs_the_reverse_kl():
    """`RLLoop._distill` (the step's distillation: the real method, on a stand-in loop holding only what it reads):
    two teachers routed by data source, the task advantage weighted by task_reward_coef."""
    from megarl.config.schema import DistillationConfig, TeacherConfig
    from megarl.data.batch import Batch
    from megarl.trainer.rl_trainer import RLLoop

    d = DistillationConfig(teachers={"a": TeacherConfig(path="x", data_source="sa"),
                                     "b": TeacherConfig(path="y", data_source="sb")}, coef=2.0, task_reward_coef=0.5)
    loop = types.SimpleNamespace(cfg=types.SimpleNamespace(distillation=d), teachers=["a", "b"],
                                 _data_sources=lambda rollout, trajectories: ["sb", "sa"])
    task = torch.ones(2, 4) * MASK
    batch = Batch({"loss_mask": MASK, "old_log_probs": STUDENT, "advantages": task.clone()})
    teacher_b_for_row0 = TEACHER.clone()
    teacher_b_for_row0[1] = -100.0  # teacher b's log-probs of row 1 are never read: row 1 is source sa
    from_a = TEACHER.clone()
    from_a[0] = -100.0  # teacher a's of row 0 neither
    metrics = RLLoop._distill(loop, batch, {"a": Batch({"log_probs": from_a}),
                                            "b": Batch({"log_probs": teacher_b_for_row0})}, None, None)
    want = 2.0 * (TEACHER - STUDENT) * MASK + 0.5 * task
    torch.testing.assert_close(batch.tensors["advantages"], want)
    # row 0 (teacher b): student - teacher on its 2 tokens = (-0.5 + 0) / 2; row 1 (teacher a): (1 - 0.5 + 2) / 3
    assert math.isclose(metrics["distill/reverse_kl/b"], -0.25, rel_tol=1e-6)
    assert math.isclose(metrics["distill/reverse_kl/a"], 2.5 / 3, rel_tol=1e-6)


# --------------------------------------------------------------------------------------------------- config


def _teacher_dir(path: pathlib.Path, tokenizer_from: pathlib.Path | None = QUICKSTART_TOKENIZER) -> str:
    """A teacher HF directory: a tiny random Llama (`make_hf_model`) with the quickstart's tokenizer (the student's)
    or, with `tokenizer_from=None`, `build_tiny_llama`'s WordLevel one ("w3".., 300 tokens)."""
    from megarl.checkpoint.tiny import build_tiny_llama, make_hf_model

    make_hf_model("llama", str(path))
    if tokenizer_from is None:
        tokenizer_from = path.parent / f"{path.name}_tokenizer"
        build_tiny_llama(str(tokenizer_from), weights=False)
    for name in os.listdir(tokenizer_from):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(tokenizer_from / name, path / name)
    return str(path)


def _cfg(tmp_path, *overrides, validate=True):
    from megarl.config.loader import apply_overrides, parse_config, read_yaml
    from megarl.config.validate import validate as check

    data = ROOT / "data" / "quickstart"
    raw = apply_overrides(read_yaml(ROOT / "yaml_configs" / "cpu_quickstart.yaml"), [
        f"logging.dir={tmp_path / 'run'}", f"data.train_path={data / 'train.jsonl'}",
        f"data.val_path={data / 'val.jsonl'}", f"model.tokenizer={QUICKSTART_TOKENIZER}", *overrides])
    cfg = parse_config(raw)
    return check(cfg) if validate else cfg


def test_a_teacher_is_placed_on_the_actors_pool_with_its_layout_resolved(tmp_path):
    path = _teacher_dir(tmp_path / "t")
    cfg = _cfg(tmp_path, f"distillation.teachers.big.path={path}", "distillation.teachers.big.parallel.tp=2",
               "distillation.coef=0.5")
    t = cfg.distillation.teachers["big"]
    assert (t.parallel.tp, t.parallel.dp, t.micro_batch_samples) == (2, 1, 1)  # dp from the pool's 2 devices
    assert cfg.distillation.enabled and cfg.distillation.coef == 0.5
    from megarl.trainer.rl_trainer import old_log_probs_from_update

    assert not old_log_probs_from_update(cfg)  # the advantages need the old log-probs before the update
    assert old_log_probs_from_update(_cfg(tmp_path, "reference.enabled=false", "algorithm.kl.coef=0",
                                          "actor.mini_batch_prompts=null"))


@pytest.mark.parametrize("overrides, match", [
    (["distillation.teachers.big.pool=other"], r"^distillation.teachers.big.pool: unknown pool 'other'"),
    (["resources.pools.own={nodes: 1, devices_per_node: 2}", "rollout.pool=own", "distillation.teachers.big.pool=own"],
     r"^distillation.teachers.big.pool: pool 'own' also hosts the rollout engines \(rollout.pool\)"),
    (["resources.pools.own={nodes: 1, devices_per_node: 2}", "reference.pool=own",
      "distillation.teachers.big.pool=own"], r"^distillation.teachers.big.pool: pool 'own' also hosts the "
                                             r"reference"),
    (["distillation.top_k=100000"], r"^distillation.top_k=100000 exceeds the vocab_size of teacher 'big', 300"),
    (["distillation.teachers.big.parallel.tp=3"], r"^distillation.teachers.big.parallel: tp\*pp\*cp = 3\*1\*1"),
    (["distillation.teachers.small.parallel.tp=2"], r"^distillation.teachers: every teacher on pool 'default' must "
                                                    r"have the same tp"),
    (["distillation.teachers.small.parallel.tp=1"], r"^distillation.teachers: with several teachers each needs a "
                                                    r"data_source"),
])
def test_bad_teacher_configs_are_refused_naming_the_key(tmp_path, overrides, match):
    from megarl.config import ConfigError

    path = _teacher_dir(tmp_path / "t")
    small = [f"distillation.teachers.small.path={path}"] if any("small" in o for o in overrides) else []
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, f"distillation.teachers.big.path={path}", *small, *overrides)


def test_a_teacher_on_a_pool_of_its_own_is_placed_and_counted_there(tmp_path):
    """Placement rows of the teacher on its own pool's global ranks (after the actor's pool's 2), at its layout; the
    --dry-run memory counts its weights on that pool, not on the actor's (against N counted by transformers)."""
    from megarl.cli import dry_run_report
    from megarl.config.memory import job_memory_estimate
    from megarl.config.placement import placement

    path = _teacher_dir(tmp_path / "t")
    own = ["resources.pools.teach={nodes: 1, devices_per_node: 2}", "distillation.teachers.big.pool=teach",
           "distillation.teachers.big.parallel.tp=2", "reference.enabled=false", "algorithm.kl.coef=0"]
    cfg = _cfg(tmp_path, f"distillation.teachers.big.path={path}", *own)
    colocated = _cfg(tmp_path, f"distillation.teachers.big.path={path}", *own[2:])
    layers = {"actor": 2, "teacher/big": 2}
    rows = [r for r in placement(cfg, layers, "cpu") if r.role == "teacher/big"]
    assert [(r.rank, r.tp, r.dp) for r in rows] == [(2, 0, 0), (3, 1, 0)]
    assert [(r.rank, r.tp) for r in placement(colocated, layers, "cpu") if r.role == "teacher/big"] == [(0, 0), (1, 1)]
    # the actor's pool no longer holds the teacher's shard
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())  # N, by transformers
    shard = n * 4 // 2  # fp32 / tp 2
    assert job_memory_estimate(colocated, None).other_roles_bytes - job_memory_estimate(cfg, None).other_roles_bytes \
        == shard
    report = dry_run_report(cfg)
    assert "# memory per GPU of the teachers' pool 'teach'" in report
    assert f"{shard / 1e6:9.2f} MB" in report.split("# memory per GPU of the teachers' pool")[1].split("\n")[1]
    # teachers on different pools may have different layouts: a colocated TP1 (dp 2) beside the TP2 one
    both = _cfg(tmp_path, f"distillation.teachers.big.path={path}", *own, f"distillation.teachers.small.path={path}",
                "distillation.teachers.small.data_source=math")
    assert both.distillation.teachers["small"].parallel.dp == 2
    assert [(r.rank, r.dp) for r in placement(both, {**layers, "teacher/small": 2}, "cpu")
            if r.role == "teacher/small"] == [(0, 0), (1, 1)]


def test_a_vllm_teacher_gets_engines_on_its_own_pool(tmp_path):
    """backend vllm: one engine per tp devices of its pool in the placement (engine rows: the whole model, dp = the
    engine index), none of its weights on the actor's pool, the dry run's pool section naming the vLLM share."""
    from megarl.cli import dry_run_report
    from megarl.config.placement import placement
    from megarl.roles.teacher import engine_teachers, teacher_pools

    path = _teacher_dir(tmp_path / "t")
    cfg = _cfg(tmp_path, f"distillation.teachers.big.path={path}", "distillation.teachers.big.backend=vllm",
               "resources.pools.teach={nodes: 1, devices_per_node: 2}", "distillation.teachers.big.pool=teach",
               "distillation.teachers.big.parallel.tp=1")
    assert engine_teachers(cfg) == ["big"] and teacher_pools(cfg) == {}  # no Megatron teacher to build anywhere
    rows = [r for r in placement(cfg, {"actor": 2, "reference": 2}, "cpu") if r.role == "teacher/big"]
    assert [(r.rank, r.tp, r.dp, r.layers) for r in rows] == [(2, 0, 0, None), (3, 0, 1, None)]
    report = dry_run_report(cfg)
    assert "teacher/big  2     0     cpu     0   -   0   -   all (engine 0)" in report
    assert "vLLM engine" in report.split("# memory per GPU of the teachers' pool 'teach'")[1]


@pytest.mark.parametrize("overrides, match", [
    ([], r"^distillation.teachers.big.backend: vllm runs the teacher on engines of their own: set "
         r"distillation.teachers.big.pool"),
    (["distillation.teachers.big.pool=teach", "distillation.teachers.big.parallel.pp=2"],
     r"^distillation.teachers.big.parallel: backend vllm takes tp only"),
    (["distillation.teachers.big.pool=teach", "distillation.top_k=4"],
     r"^distillation.top_k=4: distillation.teachers.big is vLLM-served \(backend: vllm\), which gives the log-probs"),
    (["distillation.teachers.big.pool=teach", "distillation.teachers.small.pool=teach",
      "distillation.teachers.small.data_source=math"], r"^distillation.teachers.big.pool: pool 'teach' also hosts "
                                                       r"the teacher\(s\) \['small'\]"),
])
def test_bad_vllm_teacher_configs_are_refused_naming_the_key(tmp_path, overrides, match):
    from megarl.config import ConfigError

    path = _teacher_dir(tmp_path / "t")
    small = [f"distillation.teachers.small.path={path}"] if any("small" in o for o in overrides) else []
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, f"distillation.teachers.big.path={path}", "distillation.teachers.big.backend=vllm",
             "resources.pools.teach={nodes: 1, devices_per_node: 2}", *small, *overrides)


def test_a_vllm_teacher_from_a_megatron_checkpoint_is_refused(tmp_path):
    import json

    from megarl.config import ConfigError
    from megarl.config.validate import MEGATRON_CHECKPOINT_META

    ckpt = tmp_path / "step_000001" / "actor"
    ckpt.mkdir(parents=True)
    (ckpt / MEGATRON_CHECKPOINT_META).write_text(json.dumps({"hf_config": {}}))
    with pytest.raises(ConfigError, match=r"^distillation.teachers.big.path: .* is a Megatron checkpoint; vLLM reads "
                                          r"an HF directory"):
        _cfg(tmp_path, f"distillation.teachers.big.path={ckpt}", "distillation.teachers.big.backend=vllm",
             "resources.pools.teach={nodes: 1, devices_per_node: 2}", "distillation.teachers.big.pool=teach")


def test_a_teacher_without_a_config_json_is_named(tmp_path):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^distillation.teachers.big.path: no config.json in"):
        _cfg(tmp_path, f"distillation.teachers.big.path={tmp_path}")


def test_the_distillation_keys_are_documented():
    """docs/config.md (generated from the schema, `python -m megarl.config.docs --check` in test_config) lists
    every key of the section."""
    text = (ROOT / "docs" / "config.md").read_text()
    for key in ("distillation.teachers.<name>.path", "distillation.teachers.<name>.data_source",
                "distillation.teachers.<name>.pool", "distillation.teachers.<name>.backend",
                "distillation.coef", "distillation.task_reward_coef", "distillation.top_k"):
        assert f"`{key}`" in text, key


# --------------------------------------------------------------------------------------------------- tokenizer


def test_a_teacher_with_another_tokenizer_is_refused_at_start_up_naming_both(tmp_path):
    """The training session (nothing started yet) refuses a teacher whose tokenizer is another vocabulary, naming
    the teacher, both tokenizer paths and the sizes; a teacher with the student's tokenizer files is accepted."""
    import ray

    from megarl.config import ConfigError
    from megarl.trainer.session import TrainingSession

    other = _teacher_dir(tmp_path / "other", tokenizer_from=None)  # WordLevel "w3".. vocabulary of 300
    with pytest.raises(ConfigError) as e:
        TrainingSession(_cfg(tmp_path, f"distillation.teachers.big.path={other}"))
    msg = str(e.value)
    assert msg.startswith("distillation.teachers: distillation.teachers.big: the teacher's tokenizer")
    assert other in msg and str(QUICKSTART_TOKENIZER) in msg and "vocabulary size" in msg and "300" in msg
    assert not ray.is_initialized()
    same = _teacher_dir(tmp_path / "same")
    session = TrainingSession(_cfg(tmp_path, f"distillation.teachers.big.path={same}"))
    session.close()


def test_a_tokenizer_differing_in_one_token_is_named_by_that_token(tmp_path):
    from transformers import AutoTokenizer

    from megarl.data.tokenizer_match import tokenizer_difference

    changed = tmp_path / "changed"
    shutil.copytree(QUICKSTART_TOKENIZER, changed)
    spec = json.loads((changed / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    word = next(w for w, i in vocab.items() if i > 10)
    vocab["#renamed#"] = vocab.pop(word)  # same size, one id now maps to another string
    (changed / "tokenizer.json").write_text(json.dumps(spec))
    student = AutoTokenizer.from_pretrained(str(QUICKSTART_TOKENIZER))
    teacher = AutoTokenizer.from_pretrained(str(changed))
    assert tokenizer_difference(student, student) is None
    diff = tokenizer_difference(student, teacher)
    assert diff == f"token id {vocab['#renamed#']} is {word!r} for the student but '#renamed#' for the teacher"


def test_the_memory_estimate_counts_each_teacher_as_a_forward_only_role(tmp_path):
    """A teacher on the actor's pool adds its parameters / (its tp * pp) x the dtype's bytes (fp32: 4) to the
    estimate's other roles; the count of parameters is transformers' own for the teacher's directory."""
    from transformers import AutoModelForCausalLM

    from megarl.config.memory import job_memory_estimate

    path = _teacher_dir(tmp_path / "t")
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    without = job_memory_estimate(_cfg(tmp_path), device_bytes=None)
    with_teacher = job_memory_estimate(_cfg(tmp_path, f"distillation.teachers.big.path={path}",
                                            "distillation.teachers.big.parallel.tp=2"), device_bytes=None)
    assert with_teacher.other_roles_bytes - without.other_roles_bytes == n // 2 * 4


def test_each_sample_takes_the_data_source_of_its_prompts_record():
    """`RLLoop._data_sources`: sample i's source is the `distillation.data_source_key` column of the record its
    prompt_index points to (prompt 1 was dropped here: its samples are absent), None where the record has none."""
    from megarl.config.schema import DistillationConfig
    from megarl.data.dataset import PromptRecord
    from megarl.rollout.engine import RolloutSample
    from megarl.trainer.rl_trainer import RLLoop

    records = [PromptRecord(i, f"p{i}", None, rec) for i, rec in
               enumerate([{"task": "math"}, {"task": "code"}, {}])]
    samples = [RolloutSample(p, k, [1], [2], [0.0], "stop") for p in (0, 2) for k in range(2)]
    loop = types.SimpleNamespace(cfg=types.SimpleNamespace(distillation=DistillationConfig(data_source_key="task")))
    rollout = types.SimpleNamespace(records=records, samples=samples, trajectories=None)
    assert RLLoop._data_sources(loop, rollout, [None] * 4) == ["math", "math", None, None]


def test_dry_run_places_the_teacher_on_the_actors_ranks_at_its_own_layout(tmp_path, capsys):
    """`megarl train --dry-run`'s placement table: a PP2 teacher on the 4-device actor pool (actor TP2 x DP2) has a
    row per rank, stage 0 holding layer 0 and stage 1 layer 1 of its 2 (natural order: rank = dp + 2 * pp)."""
    from megarl.cli import main

    path = _teacher_dir(tmp_path / "t")
    assert main(["train", str(ROOT / "yaml_configs" / "cpu_quickstart.yaml"), "--dry-run",
                 "resources.pools.default.devices_per_node=4", "actor.parallel.dp=2",
                 f"distillation.teachers.big.path={path}",
                 "distillation.teachers.big.parallel.pp=2"]) == 0
    lines = capsys.readouterr().out.split("# placement")[1].strip().splitlines()[3:]
    rows = {int(f[1]): (f[5], f[6], " ".join(f[8:])) for f in (line.split() for line in lines)
            if f[0] == "teacher/big"}
    assert rows == {0: ("0", "0", "0-0 of 2"), 1: ("0", "1", "0-0 of 2"), 2: ("1", "0", "1-1 of 2"),
                    3: ("1", "1", "1-1 of 2")}


# --------------------------------------------------------------------------------------------------- several teachers


def _two_teachers(top_k: int = 0):
    from megarl.config.schema import DistillationConfig, TeacherConfig

    return DistillationConfig(teachers={"m": TeacherConfig(path="x", data_source="math"),
                                        "c": TeacherConfig(path="y", data_source="code")}, coef=1.0, top_k=top_k,
                              data_source_key="task")


def test_multi_turn_rows_go_to_their_records_teacher_and_only_loss_mask_tokens_get_the_signal():
    """Several teachers with multi-turn episodes (`RLLoop._data_sources` then `RLLoop._distill`, the real methods):
    2 records (math, code) x 2 episodes, record-major as `EpisodeRunner` returns them; each row's loss mask has the
    environment's observation tokens at 0 in the middle. Each teacher gives a constant log-prob everywhere (also on
    prompt and observation tokens) and top-2 ids that name it: every row's advantage is its own teacher's constant
    minus the student's on the sampled tokens and exactly 0 elsewhere, and its top-k rows are its teacher's."""
    from megarl.data.batch import Batch
    from megarl.data.dataset import PromptRecord
    from megarl.trainer.rl_trainer import RLLoop

    records = [PromptRecord(0, "p0", None, {"task": "math"}), PromptRecord(1, "p1", None, {"task": "code"})]
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1]] * 4)  # prompt, 2 sampled, 2 observation, 2 sampled
    old = torch.full((4, 7), -1.0) * mask
    cfg = types.SimpleNamespace(distillation=_two_teachers(top_k=2),
                                rollout=types.SimpleNamespace(samples_per_prompt=2))
    loop = types.SimpleNamespace(cfg=cfg, teachers=["m", "c"])
    loop._data_sources = lambda rollout, trajectories: RLLoop._data_sources(loop, rollout, trajectories)
    rollout = types.SimpleNamespace(records=records, samples=[], trajectories=[object()] * 4)

    def teacher(value: float, token: int) -> Batch:
        return Batch({"log_probs": torch.full((4, 7), value), "top_k_ids": torch.full((4, 7, 2), token),
                      "top_k_log_probs": torch.full((4, 7, 2), value)})

    batch = Batch({"loss_mask": mask, "old_log_probs": old, "advantages": torch.zeros(4, 7)})
    metrics = RLLoop._distill(loop, batch, {"m": teacher(-0.5, 11), "c": teacher(-3.0, 22)}, rollout,
                              rollout.trajectories)
    own = torch.tensor([-0.5, -0.5, -3.0, -3.0])[:, None]  # rows 0-1: record 0 (math); rows 2-3: record 1 (code)
    torch.testing.assert_close(batch.tensors["advantages"], (own + 1.0) * mask)
    assert (batch.tensors["advantages"][mask == 0] == 0).all()
    assert batch.tensors["teacher_top_k_ids"][:, 0, 0].tolist() == [11, 11, 22, 22]
    torch.testing.assert_close(batch.tensors["teacher_top_k_log_probs"][:, 0, 0], own[:, 0])
    # the reverse KL over each teacher's rows' 4 sampled tokens each: student -1 minus the teacher's constant
    assert math.isclose(metrics["distill/reverse_kl/m"], -0.5) and math.isclose(metrics["distill/reverse_kl/c"], 2.0)


def test_episodes_that_do_not_cover_the_records_are_refused_naming_the_counts():
    from megarl.trainer.rl_trainer import RLLoop

    cfg = types.SimpleNamespace(distillation=_two_teachers(), rollout=types.SimpleNamespace(samples_per_prompt=2))
    rollout = types.SimpleNamespace(records=[None, None], samples=[], trajectories=[object()] * 3)
    with pytest.raises(RuntimeError, match=r"3 episodes for 2 records x samples_per_prompt=2"):
        RLLoop._data_sources(types.SimpleNamespace(cfg=cfg), rollout, rollout.trajectories)


def test_with_dynamic_sampling_each_sample_takes_the_source_of_the_round_that_drew_it():
    """`BatchProducer.produce` with dynamic sampling (the real selection over three hand-written rounds) then
    `RLLoop._data_sources` on the batch it returns: groups refilled from later rounds are renumbered in training
    order, and each sample's data source is that of the record its round drew (record (round k, prompt p) has
    source "k<k>p<p>"), not the first round's record at the renumbered index."""
    from megarl.data.dataset import PromptRecord
    from megarl.rollout.engine import RolloutSample
    from megarl.trainer.producer import BatchProducer, GenerationRound
    from megarl.trainer.rl_trainer import RLLoop

    same, diff = (1.0, 1.0), (0.0, 1.0)

    def round_(k, scores):
        records = [PromptRecord(p, f"r{k}p{p}", None, {"task": f"k{k}p{p}"}) for p in range(4)]
        samples = [RolloutSample(prompt_index=p, sample_index=i, prompt_ids=[k, p], response_ids=[i],
                                 response_log_probs=[0.0], finish_reason="stop") for p in range(4) for i in range(2)]
        zero = {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/error_frac": 0.0}
        return GenerationRound(records, samples, [], torch.tensor([x for pair in scores for x in pair]), zero, [])

    prepared = [round_(0, [same, diff, same, diff]), round_(1, [diff, same, same, same]),
                round_(2, [diff, diff, diff, diff])]
    producer = types.SimpleNamespace(
        cfg=types.SimpleNamespace(data=types.SimpleNamespace(prompts_per_step=4),
                                  rollout=types.SimpleNamespace(max_new_tokens=8, oversample=0),
                                  algorithm=types.SimpleNamespace(
                                      dynamic_sampling=types.SimpleNamespace(max_rounds=3, enabled=True),
                                      overlong=types.SimpleNamespace(soft_cache_tokens=None))),
        episodes=None, judge=None,
        overlong_penalty=lambda samples, metrics: BatchProducer.overlong_penalty(producer, samples, metrics),
        dynamic_sampling=lambda *args: BatchProducer.dynamic_sampling(producer, *args),
        _round=lambda index, k, client, version, t: prepared[k])
    rollout = BatchProducer.produce(producer, 1, None, 0)
    samples = rollout.samples
    loop = types.SimpleNamespace(cfg=types.SimpleNamespace(distillation=_two_teachers()))
    sources = RLLoop._data_sources(loop, rollout, [None] * len(samples))
    assert sources == [f"k{s.prompt_ids[0]}p{s.prompt_ids[1]}" for s in samples]
    assert {s.prompt_ids[0] for s in samples} == {0, 1, 2}  # groups from every round: a renumbering is exercised

