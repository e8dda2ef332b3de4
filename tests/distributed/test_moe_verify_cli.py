"""checkpoint_tools/ on mixture-of-experts models as a user runs them: `python checkpoint_tools/hf_to_megatron.py`
then `python checkpoint_tools/verify.py --megatron-dir`, for a tiny Mixtral verified at EP2 (verify starts its own
2 ranks) and a tiny Qwen3-MoE verified at TP1 (in the tool's own process), each a process of its own: every family
and every rank-start path of the tools once. Each family's checkpoint at every layout, EP1 and EP2 included, is
checked in-process by test_moe_conversion (test_offline_checkpoint_loads_at_every_layout: the converted checkpoint
gives the direct load's logits, which equal transformers'); until 2026-12-06 this module also ran the other two
(family, layout) pairs through the tools (4 more interpreters). verify's verdict is its default noise-floor rule
(transformers fp32 vs fp64): the run that crashed on every MoE model while transformers' grouped_mm expert kernel
ran the fp64 forward.

Cannot share test_moe_conversion's world: that calls the conversion functions inside its own 4 ranks, and what
is tested here is the tools' own processes (argument parsing, rank start, exit status, JSON). The two families'
chains (convert, then verify at the family's layout) run side by side; most of the module's time is the six
interpreters' start-up and imports (~5 s each: 2 conversions, 1 in-process TP1 verify, 1 EP2 parent and its 2
ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from megarl.checkpoint.tiny import make_hf_model

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "checkpoint_tools")
ARCHS = ["mixtral", "qwen3_moe"]
# arch -> the layout its converted checkpoint is verified at through the tool (module docstring)
CHECKED = {"mixtral": "ep2", "qwen3_moe": "tp1"}
# layout -> verify's extra arguments and the layout it reports (verify_topology: dp = ep when etp = tp)
LAYOUTS = {"tp1": ([], dict(tp=1, pp=1, ep=1, etp=1, dp=1)),
           "ep2": (["--ep", "2"], dict(tp=1, pp=1, ep=2, etp=1, dp=2))}
TOOL_TIMEOUT_S = 300


def _tool(name: str, *args) -> subprocess.CompletedProcess:
    """`python checkpoint_tools/<name>.py args...` in the suite's starting environment (`clean_env`, as a user's
    shell would be), bounded by TOOL_TIMEOUT_S."""
    from tests.subprocess_env import clean_env

    cmd = [sys.executable, os.path.join(TOOLS, f"{name}.py"), *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, env=clean_env())
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{' '.join(cmd[1:])} did not finish within {TOOL_TIMEOUT_S} s") from None


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _chain(root: str, arch: str) -> dict:
    """Convert `arch`'s HF directory, then verify the checkpoint at each layout. {step: (exit status, stderr tail,
    verify's JSON or None)}; a failed conversion stops the chain."""
    hf, m = os.path.join(root, arch), os.path.join(root, f"{arch}_megatron")
    out = {}
    proc = _tool("hf_to_megatron", "--hf-dir", hf, "--out", m)
    out["convert"] = (proc.returncode, proc.stderr[-3000:], None)
    if proc.returncode != 0:
        return out
    for layout in [CHECKED[arch]]:
        extra = LAYOUTS[layout][0]
        js = os.path.join(root, f"{arch}_{layout}.json")
        proc = _tool("verify", "--hf-dir", hf, "--megatron-dir", m, *extra, "--json", js)
        out[layout] = (proc.returncode, proc.stderr[-3000:], _read_json(js))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("moe_cli"))
    for i, arch in enumerate(ARCHS):
        make_hf_model(arch, os.path.join(root, arch), seed=i)
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        return dict(zip(ARCHS, pool.map(lambda a: _chain(root, a), ARCHS)))


@pytest.mark.parametrize("arch,layout", sorted(CHECKED.items()))
def test_verify_cli_passes_the_converted_moe_checkpoint(runs, arch, layout):
    """Both tools exit 0; verify judged the Megatron checkpoint at the asked layout by the fp32-vs-fp64 noise floor
    (4x on the max and the mean) and passed it; its logits agree with transformers' to within 1e-4 with the same
    argmax everywhere (the fixed bound test_moe_conversion holds every MoE layout to)."""
    rc, err, _ = runs[arch]["convert"]
    assert rc == 0, f"hf_to_megatron.py on {arch} exited {rc}: {err}"
    rc, err, v = runs[arch][layout]
    assert rc == 0 and v is not None, f"verify.py on {arch} at {layout} exited {rc}: {err}"
    assert v["passed"] and v["source"] == "megatron", v
    assert {k: v[k] for k in LAYOUTS[layout][1]} == LAYOUTS[layout][1], v
    assert "fp32 vs fp64" in v["noise_floor_source"] and 0 < v["noise_floor_max"] < 1e-4, v
    assert v["noise_floor_routing_flips"] == 0, v  # a rounding floor: both precisions chose the same experts
    assert v["tolerance"] == 4 * v["noise_floor_max"] and v["tolerance_mean"] == 4 * v["noise_floor_mean"], v
    assert v["max_abs_logit_diff"] < 1e-4 and v["argmax_agreement"] == 1.0, v

