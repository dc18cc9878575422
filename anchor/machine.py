"""The machine a result came from, recorded with every benchmark and report.

Nothing heavy is imported: versions come from package metadata, and the GPU is named only when
torch is already loaded (jaxref must never import it).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from typing import Any

PACKAGES = ("torch", "jax", "jaxlib", "transformers", "numpy", "tokenizers", "gguf", "pyarrow", "zstandard")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def machine(**extra: Any) -> dict[str, Any]:
    """Platform, CPU, cores (and those this process may use), memory, load, versions, GPU; plus `extra`."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "versions": {p: v for p in PACKAGES if (v := _version(p))},
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    if hasattr(os, "getloadavg"):
        # the CPU may be shared: timings taken under load are slower than the machine can do
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda_version=torch.version.cuda)
    info.update(extra)
    return info
