"""Native CPU kernels behind `jax.ffi`: the fused causal attention (`attention_cpu.cc`).

XLA's CPU backend writes every op's output to memory, so the attention's scores make several trips
through the caches per layer; at T=4096 that made the oracle slower than torch's fused SDPA, and the
online softmax's per-block passes made the FlashAttention-2 policies' attention cost twice the fp32
one. The kernel computes the same attention block by block, with the block's scores in cache: the
dense softmax of the `fp32` policy, and the FlashAttention-2 online softmax of the policies whose
softmax and accumulators are fp32 with operands and logits in bf16 or fp32 (`fa2_bf16`,
`paper_bf16`), the probabilities rounded where the policy rounds them (`jaxref.attention.kernel_args`
decides). Other policies keep the pure-JAX path, which is also the reference the kernel is tested
against (tests/jaxref/test_fused_attention.py): fp64 or fp16 stages, torch's `fexp_u20` exponential,
and `hf_bf16`'s dense softmax, whose JAX path is bit for bit torch's eager attention.

The same library holds the precision audit's probe (`audit_probe`): every shift's causal attention
maps against the reference shift's, reduced to the audit's column and first-key sums inside the
kernel (parity_tests/audit/maps.py); and the decoder's projections (`matmul`, `jaxref.executor.linear`): fp32
and fp64 products by a private, single-threaded copy of numpy's OpenBLAS on XLA's threads, which ran
10-30% faster than XLA's own matmuls at SmolLM2's shapes on 2 cores (each row's result independent of
the batch; tests/jaxref/test_blas_matmul.py). Without that OpenBLAS the projections stay XLA's.
Calls are shared (several batch elements in one call; several requests' x and weights in one call,
`jaxref.executor.linear_many`) only where the BLAS is position-exact (`blas_position_exact`): a row's
and a column's result the same whatever rows and columns the call holds, as OpenBLAS's AVX-512
kernels are and its Haswell kernels (AVX2 CPUs) are not.

The library is compiled on first use with the system C++ compiler (`$CXX`, else `c++`) against
jaxlib's FFI headers into `<cache>/kernels/` (`anchor_core.paths.cache_dir()`), keyed by a hash of the
source, the flags, jaxlib's version and the CPU; `make install` builds it ahead. Without a
compiler the kernel is skipped with one warning and the JAX path runs.

Whether a trace may use the kernels is an argument, `fused`, of `jaxref.forward`, the attention
functions (`jaxref.attention`) and `jaxref.executor.linear`; the gradient code passes `fused=False`
(the kernels have no VJP). The
environment variable `JAXREF_FUSED_ATTENTION=0` is the user's default switch only: `enabled()` reads
it where a public entry resolves `fused=None`, and nothing in jaxref sets it.

    python -m jaxref.kernels      # build (if needed) and print the library's path
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from anchor_core.paths import cache_dir

SOURCE = Path(__file__).with_name("attention_cpu.cc")
TARGET = "jaxref_causal_attention"
PROBE_TARGET = "jaxref_audit_probe"
MATMUL_TARGETS = {jnp.dtype(jnp.float32): "jaxref_matmul_f32", jnp.dtype(jnp.float64): "jaxref_matmul_f64"}
VARIANT_CODES = {"full": 0, "intra_doc": 1, "intra_doc_reset": 1, "anchor": 2}
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded."""


def enabled() -> bool:
    """The user's default for `fused`: False when the environment sets `JAXREF_FUSED_ATTENTION=0`.

    Read by the public entries (`jaxref.forward`, `jaxref.attention.attention` / `dense_attention`,
    `parity_tests.audit.maps.MapsRunner`) when their `fused` argument is None, once per call.
    """
    return os.environ.get("JAXREF_FUSED_ATTENTION", "1") != "0"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where the compiled library for this source, compiler flags, jaxlib and CPU lives."""
    key = hashlib.sha256("\0".join([SOURCE.read_text(), os.environ.get("CXX", "c++"), *FLAGS, jax.__version__,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"attention_cpu-{key}.so"


def build() -> Path:
    """Compile the kernel if its library is not there yet; atomic (compiled aside, then renamed)."""
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = shlex.split(os.environ.get("CXX", "c++"))
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".attention_cpu-", suffix=".so")
    os.close(fd)
    cmd = [*cxx, *FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise KernelBuildError(f"{SOURCE.name}: `{shlex.join(cmd)}` failed: "
                                   + (r.stderr.strip().splitlines() or ["(no output)"])[-1])
        os.replace(tmp, out)
    except FileNotFoundError as e:
        raise KernelBuildError(f"{SOURCE.name}: no C++ compiler ({e.filename})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@functools.cache
def available() -> bool:
    """Build, load and register the kernel once per process; False (with one warning) if that fails."""
    try:
        lib = ctypes.CDLL(str(build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxrefCausalAttention), platform="cpu")
        jax.ffi.register_ffi_target(PROBE_TARGET, jax.ffi.pycapsule(lib.JaxrefAuditProbe), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGETS[jnp.dtype(jnp.float32)],
                                    jax.ffi.pycapsule(lib.JaxrefMatmulF32), platform="cpu")
        jax.ffi.register_ffi_target(MATMUL_TARGETS[jnp.dtype(jnp.float64)],
                                    jax.ffi.pycapsule(lib.JaxrefMatmulF64), platform="cpu")
    except (KernelBuildError, OSError, AttributeError) as e:
        warnings.warn(f"jaxref: fused attention kernel unavailable, using the JAX path ({e})", stacklevel=2)
        return False
    entries = _private_blas()
    if entries is not None:
        _BLAS_EXACT.append(_position_exact(*entries))
        lib.jaxref_set_blas(ctypes.c_void_p(entries[0]), ctypes.c_void_p(entries[1]), ctypes.c_int(entries[2]),
                            ctypes.c_int(_BLAS_EXACT[0]))
    return True


# Entry points tried in numpy's OpenBLAS: (sgemm, dgemm, set_num_threads, 64-bit integers). numpy's
# wheels carry OpenBLAS built with 64-bit integers and a `scipy_` prefix; other builds export the
# plain names.
_BLAS_NAMES = (("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", "scipy_openblas_set_num_threads64_", True),
               ("cblas_sgemm64_", "cblas_dgemm64_", "openblas_set_num_threads64_", True),
               ("cblas_sgemm", "cblas_dgemm", "openblas_set_num_threads", False))
_BLAS_LIBS: list[ctypes.CDLL] = []  # the private instance once loaded (kept: the kernel holds its entry points)


def _private_blas() -> tuple[int, int, bool] | None:
    """A private, single-threaded instance of the OpenBLAS numpy loaded: (sgemm, dgemm, 64-bit integers).

    OpenBLAS's thread count is one global of the library, so numpy's instance cannot be single-threaded
    for the kernel's calls and multi-threaded for numpy's. A copy of its file under the kernels' cache
    loads as another instance (the loader tells libraries apart by file), with its own threads set to
    1 (its dependencies resolve to those numpy loaded). None when numpy's BLAS is not an OpenBLAS found
    among the process's mapped libraries, or the copy fails: then XLA's matmuls run.
    """
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps if line.split()[-1].startswith("/")
                    and "openblas" in line.split()[-1].rsplit("/", 1)[-1].lower()})
    for path in map(Path, paths):
        try:
            found = ctypes.CDLL(str(path))
            names = next((n for n in _BLAS_NAMES if all(hasattr(found, f) for f in n[:3])), None)
            if names is None:
                continue
            st = path.stat()
            key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
            copy = cache_dir() / "kernels" / f"{path.stem}-private-{key}{path.suffix}"
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=copy.parent, prefix=".blas-", suffix=path.suffix)
                os.close(fd)
                try:
                    shutil.copyfile(path, tmp)
                    os.chmod(tmp, 0o755)
                    os.replace(tmp, copy)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            blas = ctypes.CDLL(str(copy), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError:
            continue
        sgemm, dgemm, set_threads = (getattr(blas, n) for n in names[:3])
        set_threads.argtypes = [ctypes.c_int]
        set_threads(1)
        _BLAS_LIBS.append(blas)
        return ctypes.cast(sgemm, ctypes.c_void_p).value, ctypes.cast(dgemm, ctypes.c_void_p).value, names[3]
    return None


def blas_available() -> bool:
    """Whether `matmul` may run: the kernel library is loaded and a private copy of numpy's OpenBLAS too."""
    return available() and bool(_BLAS_LIBS)


def blas_position_exact() -> bool:
    """Whether `matmul` may share calls: the BLAS is loaded and gives a row and a column the same result
    whatever rows and columns its call holds (`_position_exact`, checked once per process)."""
    return blas_available() and _BLAS_EXACT[0]


_BLAS_EXACT: list[bool] = []  # `_position_exact` of the private BLAS once loaded

# (rows R, inputs K, outputs N) at which `_position_exact` checks the BLAS: odd and even sizes,
# SmolLM2's, small calls (the BLAS's small-matrix kernels) and large ones (its blocked kernel).
_POSITION_SHAPES = ((129, 97, 97), (97, 64, 160), (256, 576, 576), (257, 576, 192), (128, 576, 960))


def _position_exact(sgemm: int, dgemm: int, ilp64: bool) -> bool:
    """Whether the BLAS at `sgemm`/`dgemm` gives, bitwise, x·wᵀ's rows and columns whatever rows and
    columns the call holds: x stacked three times (each copy's rows equal x's own call), and w after
    and before another weight on the output axis (its columns equal w's own call), at
    `_POSITION_SHAPES`, fp32 and fp64. Measured: True with OpenBLAS's SkylakeX kernels (Xeon and EPYC
    CPUs with AVX-512); False with its Haswell kernels (an EPYC with AVX2 only: up to an ulp apart)."""
    integer = ctypes.c_int64 if ilp64 else ctypes.c_int
    rng = np.random.default_rng(0)
    for dt, fn, scalar in ((np.float32, sgemm, ctypes.c_float), (np.float64, dgemm, ctypes.c_double)):
        gemm = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, integer, integer, integer, scalar,
                                ctypes.c_void_p, integer, ctypes.c_void_p, integer, scalar, ctypes.c_void_p,
                                integer)(fn)

        def product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
            (m, k), n = x.shape, w.shape[0]
            y = np.empty((m, n), dt)
            gemm(101, 111, 112, m, n, k, 1.0, x.ctypes.data, k, w.ctypes.data, k, 0.0, y.ctypes.data, n)
            return y

        for R, K, N in _POSITION_SHAPES:
            x, w, other = (rng.standard_normal(s).astype(dt) for s in ((R, K), (N, K), (35, K)))
            alone = product(x, w)
            stacked = product(np.concatenate([x, x, x]), w)
            if not all(np.array_equal(stacked[i * R:(i + 1) * R], alone) for i in range(3)):
                return False
            if not (np.array_equal(product(x, np.concatenate([other, w]))[:, 35:], alone)
                    and np.array_equal(product(x, np.concatenate([w, other]))[:, :N], alone)):
                return False
    return True


def matmul(x, w):
    """`x @ wᵀ` by numpy's BLAS: x [..., K], w [N, K], both float32 or both float64; returns [..., N].

    Single-threaded BLAS calls on XLA's CPU threads, each on rows of x cut alike in every batch element
    (attention_cpu.cc says how), so a row's result does not depend on the batch around it. Call only
    after `blas_available()` returned True; the targets exist for the CPU platform only.
    """
    dt = jnp.dtype(x.dtype)
    call = jax.ffi.ffi_call(MATMUL_TARGETS[dt], jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[0]), dt))
    return call(x, w.astype(dt))


def causal_attention(q, k, v, doc_ids, variant: str, scale: float, *, logits_bf16: bool = False,
                     pv_bf16: bool = False, kv_block: int = 0):
    """Causal attention by the C++ kernel. q [B,T,N,D], k/v [B,T,K,D], doc_ids [B,T].

    q, k hold the policy's qk_in values and v its pv_in values (cast to fp32 here, exactly);
    `kv_block`: 0 for the dense fp32 softmax, else the online softmax's key block (a multiple of 16,
    or >= T for one block), with `logits_bf16` (the scaled logits rounded to bf16) and `pv_bf16` (the
    probabilities rounded to bf16 before p·v). Returns ctx [B,T,N,D] fp32: the policy's
    `dense_attention` or `online_attention`, up to rounding. Call only after `available()` returned
    True; the target exists for the CPU platform only.
    """
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), doc_ids.astype(jnp.int32),
                variant=np.int32(VARIANT_CODES[variant]), scale=np.float32(scale),
                logits_bf16=np.int32(bool(logits_bf16)), pv_bf16=np.int32(bool(pv_bf16)), kv_block=np.int32(kv_block))


def audit_probe(q, k, shifts: int, scale: float, *, logits_bf16: bool = False, first_only: bool = False):
    """The audit's probe by the C++ kernel: `first`, `col` [W, shifts-1, T] float64 (`col` all 0 when first_only).

    q [B,T,N,D], k [B,T,K,D] hold the policy's qk_in values, B = W windows × `shifts` (window-major,
    the reference shift first); causal maps, every slot one document. The numbers of
    `parity_tests.audit.maps.group_probe` on `jaxref.attention.full_probs` for a policy with fp32 qk_acc and
    softmax and logits in bf16 (`logits_bf16`) or fp32, up to rounding. Call only after `available()`.
    """
    B, T = q.shape[:2]
    out = jax.ShapeDtypeStruct((B // shifts, shifts - 1, T), jnp.float64)
    call = jax.ffi.ffi_call(PROBE_TARGET, (out, out))
    return call(q.astype(jnp.float32), k.astype(jnp.float32), shifts=np.int64(shifts), scale=np.float32(scale),
                logits_bf16=np.int32(bool(logits_bf16)), first_only=np.int32(bool(first_only)))
