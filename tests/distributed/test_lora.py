"""LoRA adapters (megarl.engine.lora) on real megatron-core over gloo (2 CPU ranks, fp32), checked against
transformers + peft loading megarl's PEFT export (megarl.checkpoint.lora_export) of the same adapters.

One spawn of 2 ranks, three layouts in turn: TP2, PP2, PP2xVPP2, on a 4-layer tiny Qwen2 (q/k/v bias, GQA, untied;
[gate; up] fc1). In each, the adapters' B get random non-zero values (B is zero at init), then:
  - logits of the adapted actor vs peft on transformers with the exported adapter, within 10x the measured fp32
    error of the base model (megarl with adapters disabled vs transformers alone), and far from the base;
  - with `adapters_disabled` the logits are transformers' base logits (the reference-from-base);
  - the gradients of a next-token loss on the adapters equal peft's (a fused linear's shared A gets the sum of its
    q/k/v or gate/up A gradients), and the optimizer holds the adapters only: a step changes them, not the base.
Then at TP2: (resume) a checkpoint of the trained adapters + optimizer holds the adapters only (no base tensor), and
a fresh engine loading it takes the same next step bit for bit; (reference for free) the LoRA actor's base with the
adapters off (`BaseOfActor`) gives bit-identical log-probs to a separate `Reference` role built on the same base.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.slow

LAYERS = 4
SETTINGS = dict(rank=4, alpha=8.0, dropout=0.0, targets=("qkv", "proj", "fc1", "fc2"))
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "pp2vpp2": dict(pp=2, vpp=2)}


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(5))


def _random_b(engine) -> None:
    """Every adapter's B random (seeded by its canonical name; a TP-split B by its TP rank too)."""
    from megarl.checkpoint.engine_io import engine_named_parameters

    for canonical, _, p in engine_named_parameters(engine):
        if canonical.endswith("lora_B.weight"):
            split = getattr(p, "tensor_model_parallel", False)
            seed = zlib.crc32(canonical.encode()) + (engine.groups.coord.tp if split else 0)
            g = torch.Generator().manual_seed(seed)
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _ranks(rank: int, world: int, hf_dir: str, out_dir: str) -> dict:
    from megarl.checkpoint.engine_io import build_engine_from_hf, engine_logits, engine_named_parameters
    from megarl.checkpoint.lora_export import engine_lora_shards, peft_tensors, write_peft_adapter
    from megarl.engine import OptimizerSettings
    from megarl.engine.lora import LoraSettings, adapters_disabled, is_lora_param, lora_transform
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from tests.distributed.harness import next_token_ce_loss

    settings = LoraSettings(**SETTINGS)
    results = {}
    for name, layout in LAYOUTS.items():
        layout = dict(layout)
        vpp = layout.pop("vpp", 1)
        groups = build_role_groups(RoleTopology(**layout))
        engine = build_engine_from_hf(hf_dir, groups, optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.0), vpp=vpp,
                                      transforms=[lora_transform(settings)])
        _random_b(engine)
        ids = _ids()
        with adapters_disabled(engine.chunks):
            base = engine_logits(engine, ids)
        adapted = engine_logits(engine, ids)
        # gradients of the mean next-token loss (megatron divides by the units), before any step
        engine.run([{"input_ids": ids}], next_token_ce_loss(engine), forward_only=False)
        grads = engine_lora_shards(engine, grads=True)
        shards = engine_lora_shards(engine)
        trainable = {canonical for canonical, _, p in engine_named_parameters(engine) if p.requires_grad}
        in_optimizer = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
        lora_numel = sum(p.numel() for _, _, p in engine_named_parameters(engine) if p.requires_grad)
        before = {c: p.detach().clone() for c, _, p in engine_named_parameters(engine)}
        engine.step()
        changed = {c for c, _, p in engine_named_parameters(engine) if not torch.equal(before[c], p.detach())}
        out = dict(trainable_all_lora=all(is_lora_param(c) for c in trainable), n_trainable=len(trainable),
                   changed_all_lora=all(is_lora_param(c) for c in changed), n_changed=len(changed),
                   optimizer_numel_le_lora=in_optimizer <= lora_numel)
        if base is not None:
            out.update(base=base, adapted=adapted)
        if shards is not None:
            tensors = peft_tensors(engine.spec, settings, shards)
            out["peft_grads"] = peft_tensors(engine.spec, settings, grads)
            out["adapter_dir"] = write_peft_adapter(f"{out_dir}/{name}", engine.spec, settings, tensors,
                                                    base_model=hf_dir)["out"]
        results[name] = out
        if name == "tp2":
            results["resume"] = _resume(engine, hf_dir, out_dir, groups, settings, ids)
            results["reference"] = _reference(hf_dir, groups, settings)
        del engine
    return results


def _lora_params(engine) -> dict:
    from megarl.checkpoint.engine_io import engine_named_parameters

    return {c: p.detach().clone() for c, _, p in engine_named_parameters(engine) if p.requires_grad}


def _resume(engine, hf_dir, out_dir, groups, settings, ids) -> dict:
    """Save the trained engine (adapters + optimizer), load into a fresh one, one more step on both."""
    from megarl.checkpoint.dist_ckpt import load_engine_checkpoint, save_engine_checkpoint
    from megarl.checkpoint.engine_io import build_engine_from_hf
    from megarl.checkpoint.lora_export import engine_lora_shards, peft_tensors
    from megarl.engine import OptimizerSettings
    from megarl.engine.lora import lora_transform
    from tests.distributed.harness import next_token_ce_loss, read_dcp

    path = f"{out_dir}/ckpt"
    save_engine_checkpoint(engine, path, hf_dir=hf_dir, with_optimizer=True)
    shards = engine_lora_shards(engine)
    saved = peft_tensors(engine.spec, settings, shards) if shards is not None else None
    fresh = build_engine_from_hf(hf_dir, groups, optimizer=OptimizerSettings(lr=1e-2, clip_grad=0.0),
                                 transforms=[lora_transform(settings)])
    load_engine_checkpoint(fresh, path, with_optimizer=True)
    loaded_equal = all(torch.equal(a, b) for a, b in zip(_lora_params(engine).values(), _lora_params(fresh).values()))
    for e in (engine, fresh):
        e.run([{"input_ids": ids}], next_token_ce_loss(e), forward_only=False)
        e.step()
    after, after_fresh = _lora_params(engine), _lora_params(fresh)
    import json
    import os

    keys = sorted(read_dcp(path)) if groups.coord.rank == 0 else None
    meta = json.load(open(os.path.join(path, "megarl_checkpoint.json")))
    same_step = all(torch.equal(after[k], after_fresh[k]) for k in after)
    return dict(path=path, saved=saved, loaded_equal=loaded_equal, same_step=same_step,
                keys=keys, meta_base=meta.get("base_model"), meta_rank=(meta.get("lora") or {}).get("rank"))


def _reference(hf_dir, groups, settings) -> dict:
    from megarl.engine import OptimizerSettings
    from megarl.models.spec import ModelSpec
    from megarl.roles.actor import Actor, BaseOfActor, Reference
    from tests.distributed.harness import padded_random_batch

    spec = ModelSpec.from_hf_dir(hf_dir)
    actor = Actor(spec, groups, hf_dir=hf_dir, optimizer=OptimizerSettings(), lora=settings)
    _random_b(actor.engine)
    reference = Reference(spec, groups, hf_dir=hf_dir)
    batch = padded_random_batch([3, 5], [6, 4], 12, 300, seed=9)
    base = BaseOfActor(actor).compute_log_probs(batch, with_entropy=False)
    ref = reference.compute_log_probs(batch, with_entropy=False)
    own = actor.compute_log_probs(batch, with_entropy=False)
    if ref is None:
        return {}
    return dict(base_equals_reference=torch.equal(base["log_probs"], ref["log_probs"]),
                adapters_matter=(own["log_probs"] - ref["log_probs"]).abs().max().item())


def _peft_reference(hf_dir: str, adapter_dir: str, ids: torch.Tensor):
    """(base logits, adapted logits, {peft parameter name: grad of the mean next-token loss}) from transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        base = model(ids).logits
    peft_model = PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
    logits = peft_model(ids).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logp.mean()).backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    return base, logits.detach(), grads


def test_lora_tp_pp_vpp_match_peft(tmp_path):
    from megarl.checkpoint.tiny import make_hf_model

    hf_dir = make_hf_model("qwen2", str(tmp_path / "hf"), num_hidden_layers=LAYERS, tie_word_embeddings=False)
    per_rank = run_ranks(2, _ranks, hf_dir, str(tmp_path / "adapters"), timeout_s=600)
    ids = _ids()
    resume = [r["resume"] for r in per_rank]
    assert all(r["loaded_equal"] and r["same_step"] for r in resume), resume
    assert resume[0]["keys"] and all("lora_" in k for k in resume[0]["keys"] if not k.startswith("optimizer")), \
        f"the LoRA checkpoint holds more than the adapters: {resume[0]['keys']}"
    assert resume[0]["meta_base"] == hf_dir and resume[0]["meta_rank"] == SETTINGS["rank"], resume[0]
    # `megarl export --lora` of that checkpoint (a process of its own): the adapters as they were saved
    import subprocess
    import sys

    from safetensors.torch import load_file

    cli = tmp_path / "cli_export"
    proc = subprocess.run([sys.executable, "-m", "megarl", "export", resume[0]["path"], "--out", str(cli), "--lora"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = load_file(str(cli / "adapter_model.safetensors"))
    assert exported.keys() == resume[0]["saved"].keys()
    assert all(torch.equal(exported[k], resume[0]["saved"][k]) for k in exported)
    reference = [r["reference"] for r in per_rank if r["reference"]]
    assert reference and all(r["base_equals_reference"] for r in reference), reference
    assert all(r["adapters_matter"] > 1e-3 for r in reference), reference
    for name in LAYOUTS:
        info = [r[name] for r in per_rank]
        assert all(i["trainable_all_lora"] and i["n_trainable"] > 0 for i in info), (name, info)
        assert all(i["changed_all_lora"] and i["n_changed"] > 0 for i in info), (name, info)
        assert all(i["optimizer_numel_le_lora"] for i in info), name
        last = next(i for i in info if "base" in i)
        first = info[0]
        hf_base, peft_logits, peft_grads = _peft_reference(hf_dir, first["adapter_dir"], ids)
        base_err = (last["base"] - hf_base).abs().max().item()
        tol = max(10 * base_err, 1e-5)
        err = (last["adapted"] - peft_logits).abs().max().item()
        assert err <= tol, f"{name}: adapted logits differ from peft by {err:.2e} > {tol:.2e} (base err {base_err:.2e})"
        assert (peft_logits - hf_base).abs().max().item() > 1000 * tol, f"{name}: the adapters change nothing"
        ours = first["peft_grads"]
        for pname, g in peft_grads.items():
            key = pname.replace(".default.", ".")
            expected = g
            fused = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"),
                     "k_proj": ("q_proj", "k_proj", "v_proj"), "v_proj": ("q_proj", "k_proj", "v_proj"),
                     "up_proj": ("gate_proj", "up_proj")}
            module = key.split(".")[-3]
            if ".lora_A." in key and module in fused:  # Megatron's fused linear shares one A: its grad is the sum
                expected = sum(peft_grads[pname.replace(module, m)] for m in fused[module])
            scale = expected.abs().max().item() + 1e-12
            diff = (ours[key] - expected).abs().max().item()
            assert diff <= 1e-4 * scale + 1e-7, f"{name}: gradient of {key} differs by {diff:.2e} (max {scale:.2e})"
