"""`tests.e2e.golden_host.kernel_class` on the three hosts the project has measured golden runs on (their flags as
`megarl.platform.host.parse_cpuinfo` reads them): each gets its own class, because each produced different
accuracies after SFT in the short addition quickstart (golden_host's docstring), and a file name per class."""

from __future__ import annotations

import pytest

from megarl.platform.host import parse_cpuinfo
from tests.e2e.golden_host import golden_path, kernel_class


def _cpuinfo(vendor: str, flags: str) -> dict:
    return parse_cpuinfo(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: x\nflags\t\t: {flags}\n")


@pytest.mark.parametrize("vendor, flags, klass", [
    ("AuthenticAMD", "sse2 avx avx2 avx512f avx512_bf16", "amd_avx512_bf16"),  # 0.07 after SFT
    ("AuthenticAMD", "sse2 avx avx2", "amd_avx2"),  # 0.045
    ("GenuineIntel", "sse2 avx avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "intel_amx"),  # 0.06
    ("GenuineIntel", "sse2 avx avx2 avx512f", "intel_avx512"),
    ("SomethingElse", "sse2", "somethingelse_other"),
])
def test_kernel_class_of_measured_hosts(vendor, flags, klass):
    info = _cpuinfo(vendor, flags)
    assert kernel_class(info["isa"], info["vendor"]) == klass
    assert golden_path("cpu_quickstart", klass).endswith(f"golden/cpu_quickstart.{klass}.json")


def test_vendor_unknown_without_vendor_line():
    assert kernel_class({"avx2": True}, None) == "unknown_avx2"
