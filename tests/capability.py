"""Run torch's CPU kernels under each capability this CPU can run, whatever capability the suite runs under.

torch compiles its CPU kernels once per capability (DEFAULT, AVX2, AVX512) and dispatches to the one
`torch.backends.cpu.get_cpu_capability()` names; `ATEN_CPU_CAPABILITY=default|avx2|avx512`, set before
torch is imported, chooses another. A test whose expectation depends on the kernel's instruction set
takes a `capability` parameter from `params()` and computes the kernel's side with `run_under`, in a
fresh interpreter with that variable set; capabilities this CPU lacks are skipped with the reason.

    @pytest.mark.parametrize("capability", capability.params())
    def test_x(capability):
        out, lse = capability.run_under(capability, "tests.jaxref.test_fexp:kernel", q, k, v, mask)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from anchor_core.machine import capabilities, cpu_flags

CAPABILITIES: tuple[str, ...] = ("default", "avx2", "avx512")
REPO = Path(__file__).resolve().parent.parent

_WORKER = """
import sys, numpy as np, importlib, torch
torch.set_num_threads(1)
want, target, src, dst = sys.argv[1:5]
got = torch.backends.cpu.get_cpu_capability()
if got != want.upper():
    sys.exit(f"asked for {want}, torch dispatches to {got}")
module, name = target.split(":")
fn = getattr(importlib.import_module(module), name)
with np.load(src) as f:
    args = [f[f"a{i}"] for i in range(len(f.files))]
out = fn(*args)
np.savez(dst, **{f"r{i}": np.asarray(x) for i, x in enumerate(out)})
"""


def params() -> list:
    """pytest params, one per capability in CAPABILITIES; those this CPU cannot run are skipped."""
    have = {c.lower() for c in capabilities()}
    return [pytest.param(c, id=c, marks=() if c in have else
                         pytest.mark.skip(reason=f"this CPU cannot run torch's {c} kernels (has: {', '.join(sorted(have))})"))
            for c in CAPABILITIES]


# torch's bf16 CPU flash attention packs its key/value blocks for AMX (`pack_vnni2`) on a CPU with
# `amx_bf16`, past a few dozen keys, whatever capability it dispatches to; the packing exists only in its
# AVX512 kernels, so under DEFAULT or AVX2 on such a CPU the kernel raises this instead of computing.
BF16_FLASH_PACK_ERROR = "pack_vnni2 is only supported when avx512 is supported"


def bf16_flash_cannot_run(capability: str) -> str | None:
    """Why torch's bf16 CPU flash attention raises under `capability` on this CPU (a skip reason), or None.

    A test that hits this asserts that the kernel still raises `BF16_FLASH_PACK_ERROR` before it skips, so
    the skip ends the day torch computes there."""
    if "amx_bf16" in cpu_flags() and capability.lower() != "avx512":
        return (f"torch's bf16 CPU flash attention cannot run under {capability} on this CPU: it packs operands "
                f"for AMX (amx_bf16) with code only its AVX512 kernels have ('{BF16_FLASH_PACK_ERROR}')")
    return None


def run_under(capability: str, target: str, *arrays: np.ndarray) -> list[np.ndarray]:
    """`module:function`(*arrays) -> tuple of arrays, called in a fresh interpreter under `capability`.

    The worker checks that torch reports the capability asked for, so a test never silently measures
    another kernel."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="anchor-cap-") as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(src, **{f"a{i}": a for i, a in enumerate(arrays)})
        proc = subprocess.run([sys.executable, "-c", _WORKER, capability, target, str(src), str(dst)],
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise AssertionError(f"{target} under ATEN_CPU_CAPABILITY={capability} failed:\n{proc.stderr[-3000:]}")
        with np.load(dst) as f:
            return [f[f"r{i}"] for i in range(len(f.files))]
