"""The machine a benchmark ran on, recorded with every result."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata


def machine() -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "memory_gib": mem, "gpu": gpu,
        "python": sys.version.split()[0],
        "versions": {p: version(p) for p in ("torch", "jax", "jaxlib", "transformers", "numpy", "tokenizers")},
    }
