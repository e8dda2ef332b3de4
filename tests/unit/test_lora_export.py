"""PEFT export layout (megarl.checkpoint.lora_export.peft_tensors), single process: Megatron adapter shards built
from known per-module PEFT matrices with the base-weight loader's own slicing (`name_map.build_shard`, the path
that reads HF weights into the engine, checked against transformers elsewhere) come back as those matrices at TP 1,
2 and 4; the fused linears' shared A goes to each of their modules. (Logit parity with peft on transformers across
TP/PP: tests/distributed/test_lora.py.)"""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.lora_export import peft_adapter_config, peft_tensors
from megarl.checkpoint.name_map import build_shard, cached_hf_shapes, module_param_layout
from megarl.checkpoint.tiny import hf_config
from megarl.engine.lora import TARGETS, LoraSettings
from megarl.models.spec import ModelSpec

RANK = 3


def _spec() -> ModelSpec:
    return ModelSpec.from_hf_config(hf_config("llama", num_attention_heads=4, num_key_value_heads=4).to_dict())


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_come_back_as_peft_modules(tp):
    spec = _spec()
    shapes = cached_hf_shapes(spec)
    g = torch.Generator().manual_seed(0)
    expected, shards = {}, {}
    for (parent, attr), kind in TARGETS.values():
        base = f"decoder.layers.1.{parent}.{attr}"
        layout = module_param_layout(spec, base + ".weight")
        hf_b = {n: torch.randn(shapes[n][0], RANK, generator=g) for n in layout.hf_names}
        in_features = shapes[layout.hf_names[0]][1]
        a = torch.randn(RANK, in_features, generator=g)
        for n in layout.hf_names:
            module = "base_model.model." + n[: -len(".weight")]
            expected[module + ".lora_B.weight"] = hf_b[n]
            expected[module + ".lora_A.weight"] = a
        if kind == "column":  # B split like the weight's rows, A replicated
            def read_b(n, d, s, e, hf_b=hf_b):
                return hf_b[n].narrow(0, s, e - s)

            shards[base + ".lora_B.weight"] = [build_shard(spec, layout, r, tp, read_b) for r in range(tp)]
            shards[base + ".lora_A.weight"] = [a]
        else:  # A split like the weight's columns, B replicated
            shards[base + ".lora_A.weight"] = [
                build_shard(spec, layout, r, tp, lambda n, d, s, e, a=a: a.narrow(1, s, e - s)) for r in range(tp)]
            shards[base + ".lora_B.weight"] = [hf_b[layout.hf_names[0]]]
    out = peft_tensors(spec, LoraSettings(rank=RANK), shards)
    assert sorted(out) == sorted(expected)
    for k in expected:
        assert torch.equal(out[k], expected[k]), k


def test_adapter_config_names_the_hf_modules():
    cfg = peft_adapter_config(LoraSettings(rank=4, alpha=8, targets=("qkv", "fc1")), _spec(), "/base")
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 8, "/base")


def test_settings_refuse_experts_and_unknown_targets():
    with pytest.raises(ValueError, match="experts.*not built"):
        LoraSettings(targets=("qkv", "experts"))
    with pytest.raises(ValueError, match="unknown target 'mlp'"):
        LoraSettings(targets=("mlp",))
