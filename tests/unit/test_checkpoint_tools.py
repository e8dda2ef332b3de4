"""checkpoint_tools/: --help, bad input (one-line error, exit status 2), atomic output, and one real CLI round
trip (HF -> Megatron -> HF in a world of one, bit-exact; verify.py on the converted checkpoint), with no vendor
warnings in the tools' output."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from megarl.checkpoint.cli import run_tool
from megarl.checkpoint.tiny import make_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "checkpoint_tools")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", os.path.join(TOOLS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture(autouse=True)
def _restore_vendor_levels():
    """The tools' main() quiets vendor logs process-wide (os.environ, logger levels): undo it after each test."""
    import logging

    from megarl.platform.vendor_logs import VENDOR_PACKAGES

    env = dict(os.environ)
    levels = {name: logging.getLogger(name).level for name in VENDOR_PACKAGES}
    yield
    os.environ.clear()
    os.environ.update(env)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


# What megatron-core prints on CPU in every process that imports it, unless quieted (7 warnings per process)
VENDOR_NOISE = ("Transformer Engine and Apex are not installed", "Apex is not installed", "UserWarning")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_model("mistral", str(tmp_path_factory.mktemp("hf") / "mistral"))


def _copy_dir(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, str(dst))
    return str(dst)


def _run(tool: str, argv, capsys) -> tuple[int, str]:
    rc = run_tool(_tool(tool), [str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return rc, err


def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("tool", ["hf_to_megatron", "megatron_to_hf", "verify"])
def test_help(tool):
    proc = subprocess.run([sys.executable, os.path.join(TOOLS, f"{tool}.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage" in proc.stdout


def test_missing_directory(tmp_path, capsys):
    rc, err = _run("hf_to_megatron", ["--hf-dir", tmp_path / "nope", "--out", tmp_path / "m"], capsys)
    assert rc == 2 and err.startswith("error: ") and "does not exist" in err and "\n" not in err


def test_unsupported_architecture_lists_supported(hf_dir, tmp_path, capsys):
    bad = _copy_dir(hf_dir, tmp_path / "gpt2")
    _edit_config(bad, architectures=["GPT2LMHeadModel"])
    rc, err = _run("hf_to_megatron", ["--hf-dir", bad, "--out", tmp_path / "m"], capsys)
    assert rc == 2 and "GPT2LMHeadModel" in err
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in err


def test_truncated_weights(hf_dir, tmp_path, capsys):
    bad = _copy_dir(hf_dir, tmp_path / "trunc")
    path = os.path.join(bad, "model.safetensors")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    rc, err = _run("hf_to_megatron", ["--hf-dir", bad, "--out", tmp_path / "m"], capsys)
    assert rc == 2 and "truncated" in err and "\n" not in err


def test_missing_weights_file(hf_dir, tmp_path, capsys):
    bad = _copy_dir(hf_dir, tmp_path / "noweights")
    os.remove(os.path.join(bad, "model.safetensors"))
    rc, err = _run("hf_to_megatron", ["--hf-dir", bad, "--out", tmp_path / "m"], capsys)
    assert rc == 2 and "model.safetensors" in err


def test_missing_tensor(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    bad = _copy_dir(hf_dir, tmp_path / "missing")
    path = os.path.join(bad, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    rc, err = _run("hf_to_megatron", ["--hf-dir", bad, "--out", tmp_path / "m"], capsys)
    assert rc == 2 and "model.layers.1.mlp.up_proj.weight is missing" in err


def test_shapes_that_do_not_match_config(hf_dir, tmp_path, capsys):
    bad = _copy_dir(hf_dir, tmp_path / "shape")
    _edit_config(bad, intermediate_size=96)
    rc, err = _run("hf_to_megatron", ["--hf-dir", bad, "--out", tmp_path / "m"], capsys)
    assert rc == 2 and "has shape [128, 64] but config.json implies [96, 64]" in err


def test_tp_that_does_not_divide_heads(hf_dir, capsys):
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--tp", 3], capsys)
    assert rc == 2 and "tp=3 does not divide num_attention_heads=4" in err


def test_tp_that_does_not_divide_query_groups(hf_dir, capsys):
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--tp", 4], capsys)
    assert rc == 2 and "tp=4 does not divide num_query_groups" in err


def test_ep_on_a_dense_model_is_refused(hf_dir, capsys):
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--ep", 2], capsys)
    assert rc == 2 and "ep=2 needs a mixture-of-experts model" in err and "MistralForCausalLM" in err


def test_etp_on_a_dense_model_is_refused(hf_dir, capsys):
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--tp", 2, "--etp", 1], capsys)
    assert rc == 2 and "etp=1 needs a mixture-of-experts model" in err


def test_etp_that_does_not_divide_the_expert_width(tmp_path, capsys):
    moe = make_hf_model("qwen3_moe", str(tmp_path / "qwen3_moe"), moe_intermediate_size=30)
    rc, err = _run("verify", ["--hf-dir", moe, "--etp", 4], capsys)
    assert rc == 2 and "etp=4 does not divide moe_ffn_hidden_size (moe_intermediate_size)=30" in err


def test_ep_that_does_not_divide_the_experts(tmp_path, capsys):
    moe = make_hf_model("qwen3_moe", str(tmp_path / "qwen3_moe"))  # 4 experts
    rc, err = _run("verify", ["--hf-dir", moe, "--ep", 3], capsys)
    assert rc == 2 and "ep=3 does not divide num_experts=4" in err


def test_vpp_that_does_not_fit_the_layers_is_refused(hf_dir, capsys):
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--pp", 2, "--vpp", 2], capsys)  # 2 layers, 4 chunks
    assert rc == 2 and "num_layers=2 must be divisible by pp*vpp=2*2" in err
    rc, err = _run("verify", ["--hf-dir", hf_dir, "--vpp", 2], capsys)
    assert rc == 2 and "vpp=2 needs pp > 1" in err


def test_existing_output_refused_without_overwrite(hf_dir, tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "metadata.json").write_text("{}")
    rc, err = _run("hf_to_megatron", ["--hf-dir", hf_dir, "--out", out], capsys)
    assert rc == 2 and "--overwrite" in err
    rc, err = _run("megatron_to_hf", ["--megatron-dir", out, "--out", tmp_path / "h"], capsys)
    assert rc == 2 and "not a megarl Megatron checkpoint" in err


def test_unfinished_output_never_looks_finished(tmp_path):
    from megarl.checkpoint.hf_io import HFWriter

    out = tmp_path / "h"
    w = HFWriter(str(out))
    w.add("x", torch.zeros(4))
    w._flush()  # a crash here leaves only the temporary directory
    assert not out.exists()
    assert any(p.name.startswith("h.tmp-") for p in tmp_path.iterdir())
    w.abort()
    assert not any(tmp_path.iterdir())


def _run_tool(args) -> str:
    """Run a tool as a user would (its own process, no warning filters of ours, the suite's starting environment
    without its rank-start settings: `clean_env`); its stdout. Fails if the tool fails or its output shows any of
    VENDOR_NOISE."""
    from tests.subprocess_env import clean_env

    proc = subprocess.run([sys.executable, os.path.join(TOOLS, args[0]), *map(str, args[1:])],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    noise = [line for line in (proc.stdout + proc.stderr).splitlines() if any(n in line for n in VENDOR_NOISE)]
    assert not noise, f"{args[0]} printed {len(noise)} vendor warning lines, e.g. {noise[:2]}"
    return proc.stdout


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _convert_verify_two_nodes(hf_dir, m_dir, json_out, tmp_dir, timeout_s: float = 600.0) -> list[str]:
    """`launch/convert_verify.sh HF [M]` as two torchrun "nodes" on this machine, as a user starts it on each node:
    NNODES=2 NODE_RANK=0|1 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=1 TP=2, both started at once (torchrun's static
    rendezvous waits for the other). Each node's output; fails naming the node that failed or did not finish (both
    are then killed with their ranks: each is its own process group)."""
    import signal

    from tests.subprocess_env import clean_env

    env = clean_env()
    env.update(PATH=f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}",  # torchrun/python of this venv
               NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NPROC_PER_NODE="1", TP="2",
               JSON_OUT=str(json_out), TMPDIR=str(tmp_dir),  # torchrun's torchelastic_* dirs stay in tmp_dir
               MEGARL_TEST_CONVERT_VERIFY=str(tmp_dir))  # marks every process of the run (checked after it)
    cmd = ["bash", os.path.join(REPO, "launch", "convert_verify.sh"), str(hf_dir), *([str(m_dir)] if m_dir else [])]
    nodes = [subprocess.Popen(cmd, env={**env, "NODE_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for r in (0, 1)]
    outs = [""] * 2
    try:
        deadline = time.monotonic() + timeout_s
        for r, p in enumerate(nodes):
            try:
                outs[r] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                raise AssertionError(f"convert_verify.sh node {r} of 2 (torchrun NODE_RANK={r}) did not finish within "
                                     f"{timeout_s:.0f} s") from None
            assert p.returncode == 0, f"convert_verify.sh node {r} of 2 exited {p.returncode}: {outs[r][-2000:]}"
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    left = _processes_with_env("MEGARL_TEST_CONVERT_VERIFY", str(tmp_dir))
    assert not left, f"processes of convert_verify.sh still running after both nodes exited: {left}"
    return outs


def _processes_with_env(key: str, value: str) -> list[str]:
    """'pid name' of every live process whose environment has key=value (started by, or under, a given run)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(key) == value:
                found.append(f"{p.pid} {p.name()}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def test_cli_round_trip_is_bit_exact(hf_dir, tmp_path):
    """HF -> Megatron -> HF bit-exact; launch/convert_verify.sh at TP 2 as two torchrun nodes of one rank each (the
    checkpoint saved by a world of one, loaded across "nodes") passes the converted checkpoint with its verdict's
    numbers in the JSON; both nodes exit 0, none of their processes is left; no tool prints megatron-core's
    warnings."""
    from safetensors.torch import load_file

    m, h2 = tmp_path / "m", tmp_path / "h2"
    for args in (["hf_to_megatron.py", "--hf-dir", hf_dir, "--out", m],
                 ["megatron_to_hf.py", "--megatron-dir", m, "--out", h2]):
        assert json.loads(_run_tool(args).strip().splitlines()[-1])["out"] == str(args[-1])
    run_tmp = tmp_path / "torchrun"
    run_tmp.mkdir()
    outs = _convert_verify_two_nodes(hf_dir, m, tmp_path / "verify.json", run_tmp)
    noise = [line for out in outs for line in out.splitlines() if any(n in line for n in VENDOR_NOISE)]
    assert not noise, f"convert_verify.sh printed {len(noise)} vendor warning lines, e.g. {noise[:2]}"
    v = json.loads((tmp_path / "verify.json").read_text())
    assert v["passed"] and v["source"] == "megatron" and v["argmax_agreement"] == 1.0, v
    assert (v["tp"], v["pp"], v["dp"]) == (2, 1, 1), v
    assert json.loads(outs[0][outs[0].index("{"):outs[0].rindex("}") + 1]) == v  # rank 0 (node 0) prints it
    assert 0 < v["noise_floor_max"] and v["tolerance"] == 4 * v["noise_floor_max"], v
    assert v["max_abs_logit_diff"] <= v["tolerance"] and v["mean_abs_logit_diff"] <= v["tolerance_mean"], v
    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(os.path.join(h2, "model.safetensors"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert os.path.isfile(os.path.join(h2, "generation_config.json"))
    # atomic.temp_dir_for names the work dir "<out>.tmp-<pid>" (the writer's pid): none may be left behind
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_verdict_judges_max_and_mean_against_the_noise_floor():
    """Hand-made reference (floor max 1e-4, mean 1e-5, so tolerances 4e-4 / 4e-5): one logit off by 3e-4 is within
    the max tolerance but puts the mean (3e-4 / 3 logits = 1e-4) over its own; --atol judges the max alone."""
    from megarl.checkpoint.verify import HFReference, verdict

    ref = HFReference(torch.tensor([[[10.0, -20.0, 5.0]]]), floor_max=1e-4, floor_mean=1e-5, floor_source="hand")
    ours = ref.logits + torch.tensor([[[3e-4, 0.0, 0.0]]])
    v = verdict(ours, ref)
    assert (v["tolerance"], v["tolerance_mean"]) == pytest.approx((4e-4, 4e-5)) and not v["passed"], v
    assert verdict(ref.logits + torch.tensor([[[3e-4, 0.0, -3e-4]]]) / 10, ref)["passed"]
    assert verdict(ours, ref, atol=1e-3)["passed"] and not verdict(ours, ref, atol=1e-4)["passed"]
    with pytest.raises(ValueError, match="noise floor, or atol"):
        verdict(ours, HFReference(ref.logits))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_noise_floor_of_a_mixture_of_experts_model(arch, tmp_path):
    """verify's reference on an MoE model: the fp32 floor needs an fp64 forward of its expert layers (transformers'
    default grouped_mm kernel refuses fp64). The reference's fp32 logits agree with transformers' default forward
    to rounding, and the floor is a rounding-sized, nonzero amount."""
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.verify import reference, token_batch

    hf = make_hf_model(arch, str(tmp_path / arch))
    ids = token_batch(300)
    ref = reference(hf, ids, "fp32")
    default = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ref.logits - default(ids).logits).abs().max() < 1e-5
    scale = float(ref.logits.abs().max())
    assert 0 < ref.floor_mean <= ref.floor_max < 1e3 * torch.finfo(torch.float32).eps * scale, ref
    assert ref.floor_source == "transformers fp32 vs fp64 forward, same batch"
    # the tiny models' router logits are far apart (weights of std 0.1): both precisions choose the same experts
    assert ref.floor_routing_flips == 0


def test_routing_flips_counts_tokens_sent_to_other_experts():
    """Hand-made router logits, top-2 of 4 experts, two layers. Layer 0: token 0 keeps {0, 1} (order swapped, same
    set), token 1 goes {2, 3} -> {1, 3}. Layer 1: token 1 goes {0, 3} -> {0, 2}. Two flips in all."""
    from megarl.checkpoint.verify import routing_flips

    a = [torch.tensor([[3.0, 2.0, 0.0, -1.0], [0.0, 1.0, 2.0, 3.0]]),
         torch.tensor([[1.0, 0.0, -1.0, -2.0], [5.0, 0.0, 1.0, 4.0]])]
    b = [torch.tensor([[2.0, 3.0, 0.0, -1.0], [0.0, 2.1, 2.0, 3.0]]),
         torch.tensor([[1.0, 0.0, -1.0, -2.0], [5.0, 0.0, 4.1, 4.0]])]
    assert routing_flips(a, b, top_k=2) == 2
    assert routing_flips(a, a, top_k=2) == 0


def test_an_fp32_floor_over_routing_flips_is_not_a_verdict():
    """A diff well within 4 floors does not pass at fp32 when the floor's two forwards routed a token differently
    (that floor is no rounding floor); the rule says why and what to do. bf16 keeps judging by its floor, --atol by
    the user's tolerance."""
    from megarl.checkpoint.verify import HFReference, verdict

    ref = HFReference(torch.tensor([[[10.0, -20.0, 5.0]]]), floor_max=1e-4, floor_mean=1e-5, floor_source="hand",
                    floor_routing_flips=1)
    ours = ref.logits + 1e-6
    v = verdict(ours, ref)
    assert not v["passed"] and v["noise_floor_routing_flips"] == 1, v
    assert "route 1 (token, MoE layer) pairs to different experts" in v["tolerance_rule"] and "--atol" in v[
        "tolerance_rule"]
    assert verdict(ours, HFReference(ref.logits, 1e-4, 1e-5, "hand", 0))["passed"]
    assert verdict(ours, ref, dtype="bf16")["passed"] and verdict(ours, ref, atol=1e-3)["passed"]
