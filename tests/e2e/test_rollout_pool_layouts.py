"""The rollout pool (`rollout.pool`) fed from an actor layout that test_rollout_pool.py (actor TP2 -> two TP1
engines) does not cover:

  moe_ep2   the MoE quickstart's tiny Qwen3-MoE (4 experts, top-2), actor EP2 (tp1, dp2: each rank the only holder
            of 2 experts, every other tensor on both) on pool "train" -> ONE vLLM engine at TP2 on pool "rollout".

An actor PP2 on the pool (the job "dense_pp2" this module also ran until 2026-12-06, ~25 s) is covered below the
e2e level: real Megatron PP2 stages sending over a bridge into a TP2 engine's ranks, every received shard equal to
the HF slice, verified, each stage sending what the plan says (tests/distributed/test_reshard_executor.py,
`x:pp2 on 2,3->tp2 on 0,1`); each stage's bytes derived by hand (tests/unit/test_reshard_disaggregated.py::
test_pp2_actor_into_one_tp2_engine); a PP2 actor trained end to end (tests/e2e/test_resume.py) and exported
(tests/distributed/test_checkpoint_layouts.py); what the pool adds to a real run (verification, shards, greedy after
a sync) here and in test_rollout_pool.py.

The driver process (`drive`, through the Python API `megarl.RLTrainer`, the engine `megarl train` runs) trains the
job on the suite's shared Ray cluster (`joined_ray_env`): the start-up sync (version 0), 2 GRPO steps (each an
update and a sync over the bridge: two syncs after an update are logged), greedy generation of the first validation
prompts through the engine, and the HF export of the actor's weights at that point. No reference model (kl.coef 0):
it is not what is tested and costs a Megatron model per rank.

What each sync is compared with, none of it from the planner or the run's own description (the expected bytes are
counted here from transformers' own parameter shapes of the config's architecture, `_hf_shapes`):
- every rollout rank receives exactly its vLLM TP2 shard: half of every tensor vLLM splits, all of every tensor it
  replicates (the RMS norms, Qwen3's per-head q/k norms, the MoE router), `_tp2_shard_bytes`; the engine ranks hold
  nothing, so that is also the lower bound the run reports;
- the bytes the two actor ranks send add up to the two shards, balanced by this theory: a rank must send its own 2
  experts' halves to both engine ranks (half the experts' bytes each); everything else is held by both, so the least
  any plan can make the busier rank send is half of the total, which the planner reaches exactly (it levels the
  shared tensors between the ranks): max/mean == 1;
- every sync is verified: each rollout rank checked every piece the plan routes into it against its sender's
  checksum (`rollout.verify_sync`, pieces > 0);
- greedy after a sync: the engine's greedy texts for the first GREEDY_PROMPTS validation prompts, after step 2's
  sync, equal transformers' greedy decoding of the exported weights, prompt for prompt.

Cost (2-core machine shared with other tests): moe_ep2 28-35 s (4 worker processes: 2 Megatron ranks, a 2-rank
vLLM engine, the bridge, in ~15 s; its first rollout warms vLLM's fused MoE kernels, ~6 s; the export reads a
Megatron checkpoint, ~3.5 s to save; the 2 steps ~1 s) plus the driver's imports (~5 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import ROOT

STEPS = 2
GREEDY_PROMPTS = 8
POOLS = {"train": {"nodes": 1, "devices_per_node": 2}, "rollout": {"nodes": 1, "devices_per_node": 2}}
LAYOUTS = {
    "moe_ep2": ("cpu_quickstart_moe.yaml", {"tp": 1, "pp": 1, "cp": 1, "dp": 2, "ep": 2}),
}


def _config(name: str, tmp) -> dict:
    import yaml

    base, parallel = LAYOUTS[name]
    cfg = yaml.safe_load(open(os.path.join(ROOT, "yaml_configs", base)))
    cfg["resources"]["pools"] = POOLS
    cfg["actor"].update(pool="train", parallel=parallel)
    cfg["reference"] = {"enabled": False}
    cfg["algorithm"]["kl"]["coef"] = 0.0
    cfg["rollout"].update(pool="rollout", tp=2, verify_sync=True)
    cfg["trainer"].update(total_steps=STEPS, val_every=0)
    for key in ("train_path", "val_path"):
        cfg["data"][key] = os.path.join(ROOT, cfg["data"][key])
    cfg["model"]["tokenizer"] = os.path.join(ROOT, cfg["model"]["tokenizer"])
    cfg["checkpoint"] = {"dir": str(tmp / "ckpt"), "save_every": 0}
    cfg["logging"].update(plots=False, dir=str(tmp / "run"))
    return cfg


def _greedy_prompts(cfg: dict) -> list[str]:
    with open(cfg["data"]["val_path"]) as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(GREEDY_PROMPTS))]


def drive(jobs: list[str]) -> None:
    """The driver (a process of its own): for each job.yaml, `STEPS` steps, the engine's greedy texts of the first
    validation prompts after the last sync (job dir / greedy.json) and the HF export (job dir / hf)."""
    import megarl

    for path in jobs:
        import yaml

        cfg = yaml.safe_load(open(path))
        out = os.path.dirname(path)
        start = time.monotonic()
        with megarl.RLTrainer(cfg) as trainer:
            for _ in range(STEPS):
                trainer.step()
            texts = trainer.generate(_greedy_prompts(cfg), temperature=0.0)
            trainer.export_hf(os.path.join(out, "hf"))
        with open(os.path.join(out, "greedy.json"), "w") as f:
            json.dump({"texts": texts, "seconds": time.monotonic() - start}, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, joined_ray_env):
    import yaml

    jobs, out = [], {}
    for name in LAYOUTS:
        tmp = tmp_path_factory.mktemp(name)
        cfg = _config(name, tmp)
        (tmp / "job.yaml").write_text(yaml.safe_dump(cfg))
        jobs.append(str(tmp / "job.yaml"))
        out[name] = {"cfg": cfg, "tmp": tmp}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", f"from tests.e2e.test_rollout_pool_layouts import drive; "
                           f"drive({jobs!r})"], cwd=ROOT, env=joined_ray_env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name, run in out.items():
        run["rows"] = [json.loads(line) for line in open(run["tmp"] / "run" / "metrics.jsonl")]
        assert [r["step"] for r in run["rows"]] == list(range(1, STEPS + 1)), name
        run["greedy"] = json.load(open(run["tmp"] / "greedy.json"))
        print(f"{name}: {run['greedy']['seconds']:.1f} s (start-up, {STEPS} steps, greedy, export)")
    print(f"driver: {time.monotonic() - start:.1f} s")
    return out


def _hf_shapes(arch: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, from transformers' own module of the config's architecture (meta device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=arch["vocab_size"], hidden_size=arch["hidden_size"],
                  intermediate_size=arch["ffn_hidden_size"], num_hidden_layers=arch["num_layers"],
                  num_attention_heads=arch["num_attention_heads"], num_key_value_heads=arch["num_query_groups"],
                  head_dim=arch["head_dim"], max_position_embeddings=arch["max_position_embeddings"],
                  tie_word_embeddings=arch["tie_word_embeddings"])
    if arch["architecture"] == "Qwen3MoeForCausalLM":
        hf = Qwen3MoeConfig(**common, num_experts=arch["num_experts"], num_experts_per_tok=arch["moe_topk"],
                            moe_intermediate_size=arch["moe_ffn_hidden_size"], norm_topk_prob=True)
        cls = Qwen3MoeForCausalLM
    else:
        hf, cls = LlamaConfig(**common), LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _nbytes(shape: tuple[int, ...]) -> int:
    n = 4  # fp32
    for d in shape:
        n *= d
    return n


def _replicated_by_vllm_tp(name: str) -> bool:
    """Whole on every vLLM TP rank: the RMS norms (Qwen3's per-head q/k norms too) and the MoE router (`mlp.gate`,
    a ReplicatedLinear); every other tensor is split in two at TP2 (vocab, heads, MLP/expert width)."""
    return name.endswith("norm.weight") or name.endswith("mlp.gate.weight")


def _tp2_shard_bytes(shapes: dict) -> int:
    """Bytes of one vLLM TP2 rank's shard: half of each split tensor, all of each replicated one."""
    return sum(_nbytes(s) if _replicated_by_vllm_tp(n) else _nbytes(s) // 2 for n, s in shapes.items())


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_sync_is_verified(runs, name):
    for r in runs[name]["rows"]:
        assert r["reshard/pool/verified"] == 1.0, (name, r["step"])
        assert r["reshard/verified_pieces"] > 0


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_rollout_rank_receives_exactly_its_shard(runs, name):
    shapes = _hf_shapes(runs[name]["cfg"]["model"]["arch"])
    shard = _tp2_shard_bytes(shapes)
    for r in runs[name]["rows"]:
        received = [r[f"reshard/pool/received_bytes_rank{i}"] for i in (0, 1)]
        assert received == [shard, shard], (name, r["step"], received, shard)
        assert r["reshard/pool/lower_bound_bytes"] == 2 * shard  # an engine rank holds nothing: all of it moves
    print(f"{name}: each rollout rank received {shard} B per sync (= its lower bound)")


def test_ep2_senders_send_half_each(runs):
    """EP2 (tp1, dp2): rank k is the only holder of experts 2k, 2k+1 (the fused `experts.*` tensors' rows [2k, 2k+2)
    along the expert dim), so it must send those experts' bytes (half to each engine rank); every other tensor is
    held by both ranks. The minimum of the larger sender is then half of everything sent (the two forced shares are
    equal), which the planner reaches exactly by levelling the shared tensors between the ranks."""
    run = runs["moe_ep2"]
    shapes = _hf_shapes(run["cfg"]["model"]["arch"])
    total = 2 * _tp2_shard_bytes(shapes)
    experts = sum(_nbytes(s) for n, s in shapes.items() if ".experts." in n)
    for r in run["rows"]:
        sent = [r[f"reshard/pool/sent_bytes_rank{i}"] for i in (0, 1)]
        assert sum(sent) == total, (r["step"], sent, total)
        assert min(sent) >= experts // 2  # its own experts at least
        assert sent == [total // 2, total // 2], (r["step"], sent, total)
        assert r["reshard/pool/sent_max_bytes"] == r["reshard/pool/sent_mean_bytes"]
    print(f"moe_ep2: actor ranks sent {sent} B (max/mean {max(sent) / (total / 2):.6f}; theory: {total // 2} each, "
          f"of which {experts // 2} its own experts)")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_after_a_sync_equals_transformers_on_the_exported_weights(runs, name):
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.data.tokenization import PromptEncoder

    run = runs[name]
    cfg = run["cfg"]
    encoder = PromptEncoder(cfg["model"]["tokenizer"], cfg["data"]["chat_template"])
    model = AutoModelForCausalLM.from_pretrained(str(run["tmp"] / "hf"), dtype=torch.float32).eval()
    eos = encoder.eos_token_id
    expected = []
    for prompt in _greedy_prompts(cfg):
        ids = torch.tensor([encoder.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=cfg["rollout"]["max_new_tokens"], do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        expected.append(encoder.decode(out[0, ids.shape[1]:].tolist()))
    assert run["greedy"]["texts"] == expected, name
