"""Full-state checkpoints of a trained `MegatronEngine` on 2 gloo ranks: weights + distributed optimizer (Adam
moments, fp32 main params, step count) + LR scheduler, saved at one layout and resumed at the same or another.

For each model (Llama untied; Qwen2 tied, which at PP=2 keeps a second copy of the embedding on the last stage):
  reference: 4 optimizer steps on fixed batches, uninterrupted; the state after step 2 is saved (full state) and
             the eval loss after every step recorded (next-token CE on a fixed held-out batch, forward only).
  resume:    a fresh engine (other seed) loads the step-2 checkpoint, runs steps 3-4 on the same batches.
The expected values are the uninterrupted run's, made in the same test. Same layout: bit-identical losses, grad norms
and final logits. Another layout (TP2 -> PP2, DP2 -> TP2): within 1e-6 (float reduction order differs). A resume
that restores the weights but not the optimizer is run too, to show the comparison can fail (step 4 differs).

`megarl export` (the CLI in a subprocess once, its function `export_hf` otherwise) turns these checkpoints into HF
directories: an untrained one saved at PP2 gives back the source safetensors bit for bit; the trained TP2 and DP2
ones give transformers the logits the Megatron engine had when it saved.
"""

from __future__ import annotations

import os

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import next_token_ce_loss

MODELS = {"llama": {}, "qwen2": {"tie_word_embeddings": True}}
STEPS = 4
SAVE_AT = 2
LAYOUT_TOL = 1e-6


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 300, (4, 12), generator=g) for _ in range(STEPS)]


def _eval_ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(8))


def _eval_loss(engine) -> float | None:
    """Next-token CE (token mean) of the eval batch on the current weights; None off the last stage."""
    out = engine.run([{"input_ids": _eval_ids()}], next_token_ce_loss(engine), forward_only=True)
    if not out:
        return None
    return float(out[0]["loss_sum"] / out[0]["units"])


def _train_step(engine, ids: torch.Tensor) -> float:
    """One optimizer step on `ids` [4, 12]; each DP rank takes its rows (the global gradient is the full batch's)."""
    dp, rank = engine.groups.topology.dp, engine.groups.coord.dp
    share = ids[rank::dp] if dp > 1 else ids
    engine.run([{"input_ids": share}], next_token_ce_loss(engine), forward_only=False)
    return engine.step()["grad_norm"]


def _worker(rank: int, world_size: int, root: str):
    import torch.distributed as dist

    from megarl.checkpoint.dist_ckpt import load_engine_checkpoint, save_engine_checkpoint
    from megarl.checkpoint.engine_io import engine_logits, load_hf_into_engine
    from megarl.checkpoint.train_state import sub_optimizers
    from megarl.engine.megatron_engine import MegatronEngine, OptimizerSettings
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology

    opt = OptimizerSettings(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, clip_grad=1.0, warmup_steps=1,
                            total_steps=STEPS, lr_schedule="cosine", min_lr=1e-3)
    batches = _batches()
    layouts = {"tp2": RoleTopology(tp=2), "pp2": RoleTopology(pp=2), "dp2": RoleTopology(dp=2)}
    groups = {name: build_role_groups(topo) for name, topo in layouts.items()}  # collective, in order
    out: dict = {}

    def record(key, engine, values):
        if engine.groups.is_last_stage and engine.groups.coord.tp == 0 and engine.groups.coord.dp == 0:
            out[key] = values

    def run(model, layout, start, ckpt_in=None, ckpt_out=None, with_optimizer=True, seed=5):
        """Steps start+1..STEPS at `layout`; from `ckpt_in` (full state) or from the HF weights."""
        hf = os.path.join(root, model)
        engine = MegatronEngine(ModelSpec.from_hf_dir(hf), groups[layout], optimizer=opt, seed=seed)
        if ckpt_in is None:
            load_hf_into_engine(engine, hf)
        else:
            load_engine_checkpoint(engine, ckpt_in, with_optimizer=with_optimizer)
        losses, norms = [], []
        for step in range(start + 1, STEPS + 1):
            norms.append(_train_step(engine, batches[step - 1]))
            losses.append(_eval_loss(engine))
            if step == SAVE_AT and ckpt_out is not None:
                save_engine_checkpoint(engine, ckpt_out, hf_dir=hf, with_optimizer=True)
                record((model, layout, "logits_at_save"), engine, engine_logits(engine, _eval_ids()))
        logits = engine_logits(engine, _eval_ids())
        record((model, layout, start, ckpt_in, with_optimizer), engine,
               {"loss": losses, "grad_norm": norms, "logits": logits, "lr": engine.optimizer.param_groups[0]["lr"],
                "steps": engine.steps,
                "foreach": [g.get("foreach") for sub in sub_optimizers(engine) for g in sub.optimizer.param_groups]})
        dist.barrier()

    for model in MODELS:
        tp2_ckpt, dp2_ckpt = os.path.join(root, f"{model}_tp2"), os.path.join(root, f"{model}_dp2")
        run(model, "tp2", 0, ckpt_out=tp2_ckpt)
        run(model, "dp2", 0, ckpt_out=dp2_ckpt)
        run(model, "tp2", SAVE_AT, ckpt_in=tp2_ckpt, seed=6)
        run(model, "tp2", SAVE_AT, ckpt_in=tp2_ckpt, seed=6, with_optimizer=False)
        run(model, "pp2", SAVE_AT, ckpt_in=tp2_ckpt, seed=6)
        run(model, "tp2", SAVE_AT, ckpt_in=dp2_ckpt, seed=6)
        # an untrained full-state checkpoint at PP2 (export must give back the HF weights bit for bit)
        hf = os.path.join(root, model)
        fresh = MegatronEngine(ModelSpec.from_hf_dir(hf), groups["pp2"], optimizer=opt, seed=5)
        load_hf_into_engine(fresh, hf)
        save_engine_checkpoint(fresh, os.path.join(root, f"{model}_pp2_init"), hf_dir=hf, with_optimizer=True)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.distributed.harness import tiny_family_dir

    root = str(tmp_path_factory.mktemp("resume"))
    for i, (model, overrides) in enumerate(MODELS.items()):
        tiny_family_dir(os.path.join(root, model), model, seed=i, **overrides)
    merged: dict = {}
    for r in run_ranks(2, _worker, root, timeout_s=900):
        merged.update(r)
    return root, merged


def _get(out, model, layout, start, ckpt=None, with_optimizer=True):
    return out[(model, layout, start, ckpt, with_optimizer)]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_same_layout_resume_is_bit_identical(runs, model):
    root, out = runs
    full = _get(out, model, "tp2", 0)
    resumed = _get(out, model, "tp2", SAVE_AT, os.path.join(root, f"{model}_tp2"))
    assert resumed["loss"] == full["loss"][SAVE_AT:], (resumed["loss"], full["loss"])
    assert resumed["grad_norm"] == full["grad_norm"][SAVE_AT:]
    assert torch.equal(resumed["logits"], full["logits"])
    assert resumed["lr"] == full["lr"] and resumed["steps"] == full["steps"] == STEPS


def test_every_engine_steps_adam_on_torchs_multi_tensor_path(runs):
    """On CPU torch resolves an unset `foreach` to its per-tensor Adam loop; the engine asks for the multi-tensor
    step (`megatron_engine._multi_tensor_adam_on_cpu`), fresh and after loading a checkpoint that recorded it. The
    bit-identical resume above is what says the two paths agree across a save."""
    _, out = runs
    recorded = [v["foreach"] for k, v in out.items() if len(k) == 5]
    assert len(recorded) == 6 * len(MODELS) and all(f and all(x is True for x in f) for f in recorded), recorded


@pytest.mark.parametrize("model", sorted(MODELS))
def test_resume_without_the_optimizer_state_differs(runs, model):
    """The control: same weights, fresh Adam moments. Step 3's eval loss is computed after step 3's update, so the
    moments already show there; the bit-identical comparison above can therefore fail."""
    root, out = runs
    full = _get(out, model, "tp2", 0)
    cold = _get(out, model, "tp2", SAVE_AT, os.path.join(root, f"{model}_tp2"), with_optimizer=False)
    assert cold["loss"][0] != full["loss"][SAVE_AT]
    assert abs(cold["loss"][-1] - full["loss"][-1]) > 1e-4, (cold["loss"], full["loss"])


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("saved,resumed", [("tp2", "pp2"), ("dp2", "tp2")])
def test_resume_at_another_layout(runs, model, saved, resumed):
    root, out = runs
    full = _get(out, model, saved, 0)
    got = _get(out, model, resumed, SAVE_AT, os.path.join(root, f"{model}_{saved}"))
    for a, b in zip(got["loss"], full["loss"][SAVE_AT:]):
        assert abs(a - b) <= LAYOUT_TOL, (got["loss"], full["loss"])
    for a, b in zip(got["grad_norm"], full["grad_norm"][SAVE_AT:]):
        assert abs(a - b) <= LAYOUT_TOL * max(1.0, abs(b)), (got["grad_norm"], full["grad_norm"])
    assert (got["logits"] - full["logits"]).abs().max().item() <= 1e-5
    assert got["steps"] == STEPS and got["lr"] == full["lr"]


# ----------------------------------------------------------------------------------------------- megarl export
def _export_rank(rank, world, src: str, out: str) -> None:
    from megarl.checkpoint.export import export_hf

    export_hf(src, out)


def _export(src: str, out: str, cli: bool = False) -> None:
    """`megarl export SRC --out OUT`: through the CLI in a subprocess when `cli` (what a user runs; ~10 s of start-up
    on 2 cores), else the function the CLI calls (`megarl.checkpoint.export.export_hf`) on a one-rank world of its
    own, forked in well under a second (`megarl.platform.spawn`), so the pytest process keeps no world."""
    if not cli:
        run_ranks(1, _export_rank, src, out, timeout_s=300)
        return
    import subprocess
    import sys

    from tests.subprocess_env import clean_env

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "megarl", "export", src, "--out", out], cwd=root, env=clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_export_of_an_untrained_checkpoint_is_the_hf_model_bit_for_bit(runs, model):
    """Saved at PP2 with its optimizer state, exported (through the CLI for llama, the CLI's function for qwen2):
    every tensor equals the source HF file's."""
    from safetensors.torch import load_file

    root, _ = runs
    out = os.path.join(root, f"{model}_pp2_init_hf")
    _export(os.path.join(root, f"{model}_pp2_init"), out, cli=model == "llama")
    before, after = load_file(os.path.join(root, model, "model.safetensors")), load_file(
        os.path.join(out, "model.safetensors"))
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k
    assert os.path.isfile(os.path.join(out, "tokenizer.json")) and os.path.isfile(os.path.join(out, "config.json"))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_export_of_a_trained_checkpoint_gives_transformers_the_trained_model(runs, model, layout):
    """transformers' logits of the exported step-2 model equal the Megatron engine's at the moment it saved (same
    tolerance as the HF<->Megatron parity tests), and differ from the untrained model's."""
    from megarl.checkpoint.verify import hf_logits

    root, out = runs
    hf_out = os.path.join(root, f"{model}_{layout}_hf")
    _export(os.path.join(root, f"{model}_{layout}"), hf_out)
    exported = hf_logits(hf_out, _eval_ids())
    megatron = out[(model, layout, "logits_at_save")]
    assert (exported - megatron).abs().max().item() < 1e-4
    assert (exported - hf_logits(os.path.join(root, model), _eval_ids())).abs().max().item() > 1e-2
