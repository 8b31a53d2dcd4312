"""Weight-only quantized linear layers on x86-64 CPUs with AVX2 + FMA: int8 (per output channel)
and int4 (groupwise, asymmetric), as the custom ops ``kvfleet::woq_int8_linear`` and
``kvfleet::woq_int4_linear``.

Why our own kernel: torch's CPU kernels for weight-only int8/int4 (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, ``torch._int_mm``) are vectorised for AVX-512; on an AVX2
machine they ran 5-10x slower than the fp32 matmul they replace (docs/performance.md,
"Weight-only quantization"), and torchao 0.18's wheels carry no x86 low-bit kernels. A decode
step is bound by reading weights, so the kernel reads each weight once, widens it to float32 in
registers and uses it for up to four rows of ``x`` (``kernels/cpu_gemv.h`` states the layouts).

Build: :func:`load` compiles ``cpu_woq.c`` and ``cpu_decoder.c`` (the fused decode step of
:mod:`kvfleet.kernels.cpu_decoder`; both include ``cpu_gemv.h``) with the system C compiler
(``$CC``, else ``cc`` / ``gcc``; ``-O3 -mavx2 -mfma -fopenmp -pthread``) into one
``<cache>/kernels/cpu_woq-<hash>.so`` (the hash covers the sources, the header and the
flags; the build is written to a temporary name and renamed, so concurrent processes do not
see half a file) and loads it with ``ctypes``; about a second, once per cache folder. A library
prebuilt into ``$KVFLEET_KERNELS_DIR`` (``python -m kvfleet.kernels.cpu_woq --prebuild DIR``,
run by the Dockerfile's ``runtime-cpu`` target at build time) is loaded from there instead, and
nothing is compiled: that folder may be read-only.
:func:`available` says whether this machine can use it: Linux x86-64, AVX2 and FMA in
``/proc/cpuinfo``, a compiler, and a build that succeeded. Callers fall back
to torch/torchao's kernels when it is False.

Shapes and dtypes (the ops check them and raise ``ValueError``):

- ``int8_linear(x [..., K] float, qdata [N, K] int8, scale [N] float32, bias [N] | None)``
  -> ``[..., N]`` in ``x.dtype``: ``x @ (qdata * scale[:, None]).T + bias``.
- ``int4_linear(x [..., K], packed [N, K/2] uint8, scale [N, K/G], shift [N, K/G], G, bias)``
  -> ``x @ W.T + bias`` with ``W[n, k] = q[n, k] * scale[n, k//G] + shift[n, k//G]``,
  ``q = unpack_int4(packed)`` in 0..15, ``G`` a multiple of 32 dividing ``K``.
  :func:`pack_int4` makes ``packed`` from ``q [N, K]`` (uint8 0..15).

Computed in float32 (``x`` is converted when it is bf16/fp16); the sums run in a different
order than a BLAS matmul, so results match ``x @ W.T`` to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_woq.c", "cpu_decoder.c"))
"""The library's C files (one ``.so``); ``cpu_gemv.h`` holds the arithmetic both share."""
HEADERS = (Path(__file__).with_name("cpu_gemv.h"),)
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-pthread", "-shared", "-fPIC")
CACHE_DIR_ENV = "KVFLEET_CACHE_DIR"
PREBUILT_DIR_ENV = "KVFLEET_KERNELS_DIR"
"""A folder of prebuilt libraries (:func:`prebuild`), looked in before the cache folder."""
PARALLEL_MIN_ENV = "KVFLEET_CPU_WOQ_PARALLEL_MIN"
PARALLEL_MIN_WEIGHTS = 1 << 16
"""Layers with fewer weights run on one thread (``$KVFLEET_CPU_WOQ_PARALLEL_MIN`` overrides):
waking a sleeping OpenMP thread costs more than a small layer takes on one core. One int8 stream
of the default model, 2 rounds: 2^16 (every layer on both threads) 17.0 / 14.7 tok/s, 2^19
(q/k/v/o on one) 17.4 / 16.0, 2^20 (all but the LM head on one) 14.7 / 12.4: within this
machine's noise, so the default stays."""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def cpu_supported(cpuinfo: str | None = None) -> bool:
    """Linux x86-64 with the ``avx2`` and ``fma`` flags (``/proc/cpuinfo``, or ``cpuinfo``)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "avx2" in flags and "fma" in flags


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _default_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvfleet"


def library_name() -> str:
    """``cpu_woq-<hash>.so``: the hash covers the sources, the header and the flags."""
    source = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    return f"cpu_woq-{hashlib.sha256(source + ' '.join(CFLAGS).encode()).hexdigest()[:16]}.so"


def build(folder: Path, cc: str) -> Path:
    """Compile the library into ``folder`` unless it is there; its path.

    Raises: OSError: the compiler failed (its last error lines are in the message)."""
    target = folder / library_name()
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        run = subprocess.run([cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if run.returncode != 0:
            os.unlink(tmp)
            raise OSError(f"{cc} failed: {run.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide a prebuilt library from other users
        os.replace(tmp, target)
    return target


def prebuild(folder: Path) -> list[Path]:
    """Compile every library variant :func:`load` may pick into ``folder`` (today one: the
    AVX2 + FMA floor), on any x86-64 build machine, whatever its CPU; each is opened once with
    ``ctypes`` (its symbols and libraries resolve). The paths; ``$KVFLEET_KERNELS_DIR`` pointed
    at ``folder`` makes :func:`load` use them.

    Raises: OSError: no compiler, or a build or the check failed."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler ($CC, cc or gcc)")
    built = [build(Path(folder), cc)]
    for path in built:
        ctypes.CDLL(str(path))
    return built


def load(cache_root: Path | None = None) -> ctypes.CDLL | None:
    """Load the kernels: prebuilt in ``$KVFLEET_KERNELS_DIR`` when there, else built (once per
    cache folder) under ``<cache_root>/kernels``; None when this machine cannot (see
    :func:`available`; the reason is logged once and kept in :func:`unavailable_reason`)."""
    global _lib, _error
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        if not cpu_supported():
            _error = "the CPU lacks AVX2/FMA (or is not Linux x86-64)"
            return None
        prebuilt = os.environ.get(PREBUILT_DIR_ENV)
        target = Path(prebuilt) / library_name() if prebuilt else None
        cc = _compiler()
        if (target is None or not target.is_file()) and cc is None:
            _error = "no C compiler ($CC, cc or gcc) to build kernels/cpu_woq.c"
            if target is not None:
                _error += f", and no {target}"
            logger.warning("weight-only quantized CPU kernels unavailable: %s", _error)
            return None
        try:
            if target is None or not target.is_file():
                target = build((cache_root or _default_root()) / "kernels", cc)
            lib = ctypes.CDLL(str(target))
        except OSError as exc:
            _error = f"building or loading {library_name()} failed: {exc}"
            logger.warning("weight-only quantized CPU kernels unavailable: %s", _error)
            return None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.kv_woq_int8_linear.argtypes = [p, i64, i64, i64, p, i64, p, p, p]
        lib.kv_woq_int4_linear.argtypes = [p, i64, i64, i64, p, i64, p, p, i64, p, p]
        lib.kv_woq_int4_dequant.argtypes = [p, i64, i64, p, p, i64, p]
        lib.kv_woq_set_parallel_min.argtypes = [i64]
        lib.kv_woq_set_parallel_min(int(os.environ.get(PARALLEL_MIN_ENV, "") or PARALLEL_MIN_WEIGHTS))
        lib.kv_woq_int8_linear.restype = lib.kv_woq_int4_linear.restype = lib.kv_woq_int4_dequant.restype = None
        lib.kv_pool_start.argtypes, lib.kv_pool_start.restype = [i64, i64], i64
        lib.kv_decode_profile.argtypes, lib.kv_decode_profile.restype = [p], None
        lib.kv_decode.argtypes, lib.kv_decode.restype = [p, i64, p, p, p, p, p, i64, p, p, p], i64
        _lib = lib
        return lib


def available(cache_root: Path | None = None) -> bool:
    """Whether the kernels run on this machine (builds them on first call)."""
    return load(cache_root) is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it has not or it succeeded)."""
    return _error


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(x: torch.Tensor, w: torch.Tensor, wdtype: torch.dtype, K: int, N: int, bias) -> None:
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError("kvfleet woq kernels run on CPU tensors only")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {K}")
    if w.dtype != wdtype or not w.is_contiguous():
        raise ValueError(f"weight must be a contiguous {wdtype} tensor, got {w.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be float32 [{N}], got {bias.dtype} {tuple(bias.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2.contiguous()


def _as_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 ``[rows, N]`` output shaped and typed like ``x`` (``[..., N]``)."""
    y = y.view(*x.shape[:-1], y.shape[-1])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _lib_or_raise() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"kvfleet woq kernels unavailable: {_error}")
    return lib


def int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (qdata * scale[:, None]).T + bias`` (see the module docstring); ``x`` [..., K].
    Under ``torch.compile`` it is the opaque op ``kvfleet::woq_int8_linear``; eagerly a plain
    call (a custom op's Python dispatch costs tens of microseconds a call)."""
    if torch.compiler.is_compiling():
        return torch.ops.kvfleet.woq_int8_linear(x, qdata, scale, bias)
    return _int8_linear(x, qdata, scale, bias)


def _int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    N, K = qdata.shape
    _check(x, qdata, torch.int8, K, N, bias)
    if scale.shape != (N,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous float32 [{N}], got {scale.dtype} {tuple(scale.shape)}")
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    if x2.shape[0]:
        _lib_or_raise().kv_woq_int8_linear(x2.data_ptr(), x2.shape[0], K, K, qdata.data_ptr(), N,
                                          scale.data_ptr(), _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for groupwise int4 ``W`` (see the module docstring); ``x`` [..., K].
    ``kvfleet::woq_int4_linear`` under ``torch.compile``, a plain call eagerly."""
    if torch.compiler.is_compiling():
        return torch.ops.kvfleet.woq_int4_linear(x, packed, scale, shift, group_size, bias)
    return _int4_linear(x, packed, scale, shift, group_size, bias)


def _int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    N, half = packed.shape
    K = 2 * half
    _check(x, packed, torch.uint8, K, N, bias)
    if group_size % 32 or K % group_size:
        raise ValueError(f"group_size must be a multiple of 32 dividing K={K}, got {group_size}")
    for name, t in (("scale", scale), ("shift", shift)):
        if t.shape != (N, K // group_size) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [{N}, {K // group_size}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    if x2.shape[0]:
        _lib_or_raise().kv_woq_int4_linear(x2.data_ptr(), x2.shape[0], K, K, packed.data_ptr(), N, scale.data_ptr(),
                                          shift.data_ptr(), group_size, _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def _int8_fake(x, qdata, scale, bias):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


def _int4_fake(x, packed, scale, shift, group_size, bias):
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


torch.library.custom_op("kvfleet::woq_int8_linear", _int8_linear, mutates_args=()).register_fake(_int8_fake)
torch.library.custom_op("kvfleet::woq_int4_linear", _int4_linear, mutates_args=()).register_fake(_int4_fake)


def int8_linear_unchecked(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int8_linear` without the argument checks or the op dispatch, for a layer whose
    weights were checked once (``kvfleet.runtime.worker.woq_linear``); call :func:`load` first."""
    N, K = qdata.shape
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib.kv_woq_int8_linear(x2.data_ptr(), x2.shape[0], K, K, qdata.data_ptr(), N, scale.data_ptr(),
                            _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int4_linear_unchecked(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                          group_size: int, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`int4_linear` without the argument checks or the op dispatch (see
    :func:`int8_linear_unchecked`)."""
    N, half = packed.shape
    x2 = _rows(x)
    y = torch.empty((x2.shape[0], N), dtype=torch.float32)
    _lib.kv_woq_int4_linear(x2.data_ptr(), x2.shape[0], 2 * half, 2 * half, packed.data_ptr(), N, scale.data_ptr(),
                            shift.data_ptr(), group_size, _ptr(bias), y.data_ptr())
    return _as_input(y, x)


def int4_dequantize(packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 ``[N, K]`` weight of an int4 layer (``q * scale + shift`` per group), for
    steps with many rows (unchecked, like :func:`int4_linear_unchecked`), written into ``out``
    (a contiguous float32 ``[N, K]`` tensor) when given."""
    N, half = packed.shape
    if out is None:
        out = torch.empty((N, 2 * half), dtype=torch.float32)
    _lib.kv_woq_int4_dequant(packed.data_ptr(), N, 2 * half, scale.data_ptr(), shift.data_ptr(), group_size,
                             out.data_ptr())
    return out


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (integers 0..15, K a multiple of 32) -> ``[N, K/2]`` uint8 in the kernel's
    layout: per block of 32, byte ``j`` = ``q[32b + j] | q[32b + 16 + j] << 4``.

    Raises: ValueError: K not a multiple of 32, or values outside 0..15."""
    N, K = q.shape
    if K % 32:
        raise ValueError(f"K={K} is not a multiple of 32")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError("int4 values must lie in 0..15")
    blocks = q.to(torch.uint8).reshape(N, K // 32, 2, 16)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[N, K/2]`` uint8 -> ``[N, K]`` uint8 in 0..15."""
    N, half = packed.shape
    blocks = packed.reshape(N, half // 16, 16)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(N, 2 * half)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfleet.kernels.cpu_woq --prebuild DIR``: :func:`prebuild` into DIR."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvfleet.kernels.cpu_woq", description=main.__doc__)
    parser.add_argument("--prebuild", type=Path, required=True, metavar="DIR",
                        help="compile the kernel libraries into DIR (for $KVFLEET_KERNELS_DIR)")
    args = parser.parse_args(argv)
    for path in prebuild(args.prebuild):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
