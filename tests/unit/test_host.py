"""`megarl.platform.host.parse_cpuinfo` on given /proc/cpuinfo and lscpu texts (abridged from real hosts: an Intel
Sapphire Rapids with AMX, this project's AMD EPYC CPU machines without it, an Arm Neoverse), and `host_cpu` on this
host against /proc/cpuinfo read here."""

from __future__ import annotations

import os

import pytest

from megarl.platform.host import ISA_FLAGS, describe_host, host_cpu, parse_cpuinfo

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni
"""
NEOVERSE = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm bf16 sve
CPU implementer\t: 0x41
"""
LSCPU = """Architecture:                            x86_64
CPU(s):                                  2
Vendor ID:                               AuthenticAMD
Model name:                              AMD EPYC
Flags:                                   fpu sse2 avx avx2 avx512f avx512_bf16
"""


def _isa(*present: str) -> dict:
    return {**{f: f in present for f in ISA_FLAGS}, "amx": any(f.startswith("amx") for f in present)}


@pytest.mark.parametrize("text, model, vendor, cpus, isa", [
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8480+", "intel", 2,
     _isa("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
    (EPYC, "AMD EPYC", "amd", 2, _isa("avx2", "avx512f", "avx512_bf16")),
    (NEOVERSE, None, None, 1, _isa()),  # Arm: no model name in /proc/cpuinfo, no x86 flags among its Features
    (LSCPU, "AMD EPYC", "amd", 2, _isa("avx2", "avx512f", "avx512_bf16")),
    ("", None, None, 0, _isa()),
], ids=["sapphire-rapids", "epyc", "neoverse", "lscpu", "empty"])
def test_parse_cpuinfo(text, model, vendor, cpus, isa):
    info = parse_cpuinfo(text)
    assert info == {"model": model, "vendor": vendor, "logical_cpus": cpus, "isa": isa}
    assert info["isa"]["amx"] is (model is not None and "Intel" in model)  # only the AMX host says amx


def test_host_cpu_reads_this_host():
    info = host_cpu()
    assert set(info) == {"model", "vendor", "logical_cpus", "isa", "source"} and info["model"]
    if os.path.exists("/proc/cpuinfo"):
        text = open("/proc/cpuinfo").read()
        assert info["source"] == "/proc/cpuinfo" and info["logical_cpus"] == text.count("processor\t:")
        first_flags = next(line for line in text.splitlines() if line.startswith(("flags", "Features"))).split()
        assert info["isa"]["avx2"] is ("avx2" in first_flags)


def test_describe_host_names_the_model_vendor_isa_and_cpus():
    """The line a results page prints (benchmarks/agentic.py, prefix_cache.py): from the parsed Sapphire Rapids text,
    its flags in ISA_FLAGS order; an unknown host says so."""
    assert describe_host(parse_cpuinfo(SAPPHIRE_RAPIDS)) == (
        "Intel(R) Xeon(R) Platinum 8480+ (intel; avx2, avx512f, avx512_bf16, amx_tile, amx_bf16, amx_int8), 2 CPUs")
    assert describe_host({}) == "? (?; no listed ISA extensions), ? CPUs"


def test_every_benchmark_that_writes_json_records_the_host():
    """Each benchmarks/*.py that writes a result JSON puts `host_cpu()` under a "host_cpu" key (a new benchmark must
    too)."""
    import glob
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    scripts = sorted(glob.glob(os.path.join(root, "*.py")))
    assert len(scripts) >= 8
    for path in scripts:
        text = open(path).read()
        if "json.dump(" in text:
            assert re.search(r"megarl\.platform\.host import [^\n]*\bhost_cpu\b", text), path
            assert re.search(r"""["']host_cpu["']\s*[:\]]|host_cpu=host_cpu\(\)""", text), path
