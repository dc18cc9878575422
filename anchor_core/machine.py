"""The machine a result came from, recorded with every benchmark and report.

Nothing heavy is imported: versions come from package metadata, and the GPU is named only when
torch is already loaded (jaxref must never import it).

The CPU's instruction set matters to the numbers: torch's CPU kernels are compiled once per
*capability* (`DEFAULT`, `AVX2`, `AVX512`) and dispatch to the one `cpu_capability()` names, and
they do not compute the same thing (the bf16 flash-attention kernel's fast exponential covers
8 lanes under AVX2, 16 under AVX512, none under DEFAULT; jaxref.policy.cpu_kernel_policy). A CPU
with bf16 instructions (`avx512_bf16`, `amx_bf16`) also multiplies bf16 faster than fp32, where an
AVX2-only CPU is 3-6x slower (`bf16_matmul_speedup`).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from importlib import metadata
from typing import Any

# The load when this module was first imported (the `anchor` package imports it first of all): a
# benchmark records it with the load at its end, so a result taken beside other work says so.
LOAD_AT_START: tuple[float, float, float] | None = os.getloadavg() if hasattr(os, "getloadavg") else None

PACKAGES = ("torch", "jax", "jaxlib", "transformers", "numpy", "tokenizers", "gguf", "pyarrow", "zstandard")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# torch's choice (aten/src/ATen/native/DispatchStub.cpp, compute_cpu_capability): AVX512 needs
# avx512vl, avx512bw, avx512dq and fma; AVX2 needs avx2 and fma; the environment variable
# ATEN_CPU_CAPABILITY=default|avx2|avx512 overrides the choice (a capability the CPU lacks then
# crashes on its first vector instruction: `capabilities()` lists those this CPU can run).
_NEEDS: dict[str, tuple[str, ...]] = {
    "AVX512": ("avx512vl", "avx512bw", "avx512dq", "fma"),
    "AVX2": ("avx2", "fma"),
    "DEFAULT": (),
}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def capabilities() -> tuple[str, ...]:
    """The capabilities of torch's CPU kernels this CPU can run, best first (x86; elsewhere what torch
    reports, or `("DEFAULT",)`)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        own = _torch_capability()
        return (own, "DEFAULT") if own and own != "DEFAULT" else ("DEFAULT",)
    flags = cpu_flags()
    return tuple(c for c, needs in _NEEDS.items() if all(f in flags for f in needs))


def _torch_capability() -> str | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old or partial torch: fall back to the rule
        return None


def cpu_capability() -> str:
    """The capability torch's CPU kernels dispatch to in this process: torch's answer when torch is
    loaded, else torch's rule applied to this CPU and `ATEN_CPU_CAPABILITY` (importing nothing)."""
    own = _torch_capability()
    if own is not None:
        return own
    env = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if env in _NEEDS:
        return env
    return capabilities()[0]


def cpu_bf16() -> list[str]:
    """The CPU's bf16 instruction sets (`avx512_bf16`, `amx_bf16`); empty where it has none."""
    return [f for f in BF16_FLAGS if f in cpu_flags()]


def package_version(pkg: str) -> str | None:
    """The installed version of distribution `pkg`, None when it is not installed."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def commit() -> str | None:
    """The checkout's commit (12 hex digits, `+dirty` when tracked files differ from it): a recorded result names
    the code that produced it (the results pages show it). Outside a git checkout (a copy of the tree on a GPU
    machine without network, copied without .git), `ANCHOR_COMMIT` where it holds such a name (the commands of
    tools/gpu_parity.sh set it from the checkout the tree was copied from), else None."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        given = os.environ.get("ANCHOR_COMMIT", "")
        return given if re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", given) else None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def machine(**extra: Any) -> dict[str, Any]:
    """Platform, CPU, cores (and those this process may use), memory, load, versions, GPU, the time (UTC) and
    the checkout's commit; plus `extra`."""
    info: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_capability": cpu_capability(),
        "cpu_capabilities": list(capabilities()),
        "cpu_bf16": cpu_bf16(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "versions": {p: v for p in PACKAGES if (v := package_version(p))},
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if hasattr(os, "getloadavg"):
        # the CPU may be shared: timings taken under load are slower than the machine can do
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if LOAD_AT_START is not None:
        info["load_average_at_start"] = [round(x, 2) for x in LOAD_AT_START]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda_version=torch.version.cuda)
    info.update(extra)
    return info
