"""kvfleet's C library for the CPU: its build (one variant per ISA level), its ctypes bindings and
the ABI check. The one module that compiles, names, loads and binds it; the ops over it live in
:mod:`kvfleet.kernels.cpu_woq` (weight-only linear layers) and :mod:`kvfleet.kernels.cpu_decoder`
(the fused decode step).

Sources: ``cpu_woq.c`` and ``cpu_decoder.c`` (both include ``cpu_gemv.h`` (several rows, over
``cpu_gemv_m1.h``'s formats and one-row dot products), ``cpu_dpbf16.h`` and ``cpu_amx.h``;
``cpu_decoder.h`` holds the decoder's structs and their sizes for the ABI check; the decoder's
pool, step state, cache writes and attention are ``cpu_pool.h``, ``cpu_step.h``, ``cpu_kv_write.h``
and ``cpu_attention.h``, a layer's mixture of experts ``cpu_moe.h``, LoRA adapters' deltas
``cpu_lora.h``, tensor parallelism's sums of the ranks' partial outputs ``cpu_tp.h``), one ``.so``.

Variants (:data:`VARIANT_FLAGS`), chosen at run time by :func:`variant_for` from
:func:`kvfleet.kernels.cpu_features.detect` (``$KVFLEET_CPU_ISA`` caps it):

- ``avx2`` (the floor): ``-mavx2 -mfma -mf16c``; 8-wide loads and FMAs.
- ``avx512``: adds ``-mavx512f -mavx512bw -mavx512dq -mavx512vl``; the one-row (decode) dot
  products run 16 wide (``cpu_gemv.h``, ``__AVX512F__``).
- ``avx512_bf16``: adds ``-mavx512bf16 -mavx512vnni``: the ``avx512`` code plus the bf16
  dot-product kernels of ``cpu_dpbf16.h`` (``vdpbf16ps``: the fused decoder's matmuls in bf16, when
  its caller asks).
- ``amx``: adds ``-mamx-tile -mamx-bf16``: the ``avx512_bf16`` code plus the AMX tile kernels of
  ``cpu_amx.h`` (the fused decoder's matmuls in bf16 on tiles, when its caller asks). A compiler
  without AMX support falls back to ``avx512_bf16``.

Build: the system C compiler (``$CC``, else ``cc`` / ``gcc``) with :data:`COMMON_FLAGS` and the
variant's flags, into ``<cache>/kernels/kvfleet_cpu-<variant>-<hash>.so`` (``<cache>`` is
``$KVFLEET_CACHE_DIR`` or ``~/.cache/kvfleet``; the hash covers the sources, the header and the
flags; written to a temporary name and renamed, so concurrent processes never see half a file);
about a second per variant, once per cache folder. A library prebuilt into ``$KVFLEET_KERNELS_DIR``
(:func:`prebuild`, run by the Dockerfile's ``runtime-cpu`` target) is loaded from there instead, and
nothing is compiled: that folder may be read-only.

ABI check: the C side exports ``kv_abi_sizes``, the ``sizeof`` of each struct the ctypes side
mirrors (:data:`STRUCTS`: ``kv_matrix``, ``kv_layer``, ``kv_decoder``, ``kv_moe``, ``kv_lora``);
:func:`load` compares them with ``ctypes.sizeof`` and refuses a library that disagrees
(:class:`AbiMismatch`, logged, and :func:`available` is False), rather than pass misread pointers to C.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import kvfleet.runtime.env as env  # the settings registry: stdlib only, below every layer
from kvfleet.kernels import cpu_features

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("cpu_woq.c", "cpu_decoder.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("cpu_gemv_m1.h", "cpu_gemv.h", "cpu_dpbf16.h", "cpu_amx.h",
                                                     "cpu_decoder.h", "cpu_pool.h", "cpu_step.h",
                                                     "cpu_kv_write.h", "cpu_attention.h", "cpu_attention16.h",
                                                     "cpu_moe.h", "cpu_lora.h", "cpu_perm.h", "cpu_tp.h"))
COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-pthread", "-shared", "-fPIC")
_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl")
VARIANT_FLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", *_AVX512),
    "avx512_bf16": ("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16", "-mavx512vnni"),
    "amx": ("-mavx2", "-mfma", "-mf16c", *_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
}
"""Compiler flags of each build variant (beyond :data:`COMMON_FLAGS`)."""
_LEVEL_VARIANT = {"avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512_bf16", "amx": "amx"}
CACHE_DIR_ENV = env.CACHE_DIR.name
PREBUILT_DIR_ENV = env.KERNELS_DIR.name
"""A folder of prebuilt libraries (:func:`prebuild`), looked in before the cache folder."""
PARALLEL_MIN_ENV = env.CPU_WOQ_PARALLEL_MIN.name
PARALLEL_MIN_WEIGHTS = env.CPU_WOQ_PARALLEL_MIN.default
"""Layers with fewer weights run on one thread in the ``cpu_woq`` ops (``$KVFLEET_CPU_WOQ_PARALLEL_MIN``
overrides): waking a sleeping OpenMP thread costs more than a small layer takes on one core. One
int8 stream of the default model, 2 rounds: 2^16 (every layer on both threads) 17.0 / 14.7 tok/s,
2^19 (q/k/v/o on one) 17.4 / 16.0, 2^20 (all but the LM head on one) 14.7 / 12.4: within this
machine's noise, so the default stays."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class Matrix(ctypes.Structure):
    """``kv_matrix`` (cpu_gemv.h)."""

    _fields_ = [("fmt", _i64), ("N", _i64), ("K", _i64), ("w", _ptr), ("scale", _ptr), ("shift", _ptr),
                ("group", _i64), ("bias", _ptr), ("perm", _ptr), ("kind", _i64), ("scale_f16", _i64),
                ("hbits", _ptr), ("scale_d", _ptr), ("shift_d", _ptr), ("super_group", _i64)]


class Moe(ctypes.Structure):
    """``kv_moe`` (cpu_decoder.h)."""

    _fields_ = [("num_experts", _i64), ("top_k", _i64), ("intermediate", _i64), ("norm_topk_prob", _i64),
                ("scoring", _i64), ("router", Matrix), ("gate_up", ctypes.POINTER(Matrix)),
                ("down", ctypes.POINTER(Matrix))]


class LoraPart(ctypes.Structure):
    """``kv_lora_part`` (cpu_decoder.h)."""

    _fields_ = [("a", _ptr), ("b", _ptr), ("n0", _i64), ("n", _i64)]


LORA_PARTS = 7
"""``KV_LORA_PARTS``: q, k, v, o, gate, up, down."""


class Lora(ctypes.Structure):
    """``kv_lora`` (cpu_decoder.h)."""

    _fields_ = [("part", LoraPart * LORA_PARTS)]


class Layer(ctypes.Structure):
    """``kv_layer`` (cpu_decoder.h)."""

    _fields_ = [("attn_in_norm", _ptr), ("attn_out_norm", _ptr), ("mlp_in_norm", _ptr), ("mlp_out_norm", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("qkv", Matrix), ("o", Matrix), ("gate_up", Matrix),
                ("down", Matrix), ("k_cache", _ptr), ("v_cache", _ptr), ("window", _i64), ("rope", _i64),
                ("moe", ctypes.POINTER(Moe)), ("lora", ctypes.POINTER(Lora))]


class Decoder(ctypes.Structure):
    """``kv_decoder`` (cpu_decoder.h)."""

    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
                ("head_size", _i64), ("intermediate", _i64), ("block_size", _i64), ("eps", ctypes.c_double),
                ("scale", ctypes.c_double), ("layers", ctypes.POINTER(Layer)), ("final_norm", _ptr),
                ("head", ctypes.POINTER(Matrix)), ("cache_dtype", _i64), ("matmul", _i64),
                ("qk_norm", _i64), ("act", _i64), ("rotary_dim", _i64), ("rotary_interleaved", _i64),
                ("residual_scale", ctypes.c_double), ("lora_rank", _i64), ("lora_slots", _ptr),
                ("all_reduce", _ptr)]   # a CFUNCTYPE(int64, float *, int64) (kernels/cpu_tp.py), or None


STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = (("kv_matrix", Matrix), ("kv_layer", Layer),
                                                          ("kv_decoder", Decoder), ("kv_moe", Moe), ("kv_lora", Lora))
"""The C structs mirrored here, in ``kv_abi_sizes``'s order."""


class AbiMismatch(OSError):
    """The library's structs differ from their ctypes mirrors (a stale or foreign build)."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_variant: str | None = None
_error: str | None = None


def variant_for(features: cpu_features.CpuFeatures) -> str | None:
    """The build variant for a CPU: its ISA level's (``amx`` takes ``avx512_bf16``), None below AVX2."""
    return _LEVEL_VARIANT.get(features.isa_level) if features.isa_level else None


def compiler() -> str | None:
    """The C compiler: ``$CC``, else ``cc`` or ``gcc`` on the PATH; None without one."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _default_root() -> Path:
    return env.CACHE_DIR.get()


def library_name(variant: str) -> str:
    """``kvfleet_cpu-<variant>-<hash>.so``: the hash covers the sources, the headers and the flags.

    Raises:
        ValueError: an unknown variant.
    """
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"unknown variant {variant!r}; one of {', '.join(VARIANT_FLAGS)}")
    flags = (*COMMON_FLAGS, *VARIANT_FLAGS[variant])
    source = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    return f"kvfleet_cpu-{variant}-{hashlib.sha256(source + ' '.join(flags).encode()).hexdigest()[:16]}.so"


def build(variant: str, cache_root: Path | None = None, *, folder: Path | None = None) -> Path:
    """The ``.so`` path of ``variant``: prebuilt in ``$KVFLEET_KERNELS_DIR`` when there (nothing is
    compiled, the folder may be read-only), else compiled (unless its file exists) into ``folder``
    (default ``<cache_root>/kernels``). Compiling needs no CPU support: every variant builds on any
    x86-64 machine (tests compile the AVX-512 ones on AVX2 machines).

    Raises:
        ValueError: an unknown variant.
        OSError: no compiler, or it failed (its last lines in the message).
    """
    name = library_name(variant)
    prebuilt = env.KERNELS_DIR.get()
    if folder is None and prebuilt and (Path(prebuilt) / name).is_file():
        return Path(prebuilt) / name
    folder = folder if folder is not None else (cache_root or _default_root()) / "kernels"
    target = Path(folder) / name
    if target.exists():
        return target
    cc = compiler()
    if cc is None:
        where = f", and no {name} in ${PREBUILT_DIR_ENV}={prebuilt}" if prebuilt else ""
        raise OSError(f"no C compiler ($CC, cc or gcc) to build the CPU kernels{where}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    flags = (*COMMON_FLAGS, *VARIANT_FLAGS[variant])
    run = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
    if run.returncode != 0:
        os.unlink(tmp)
        raise OSError(f"{cc} failed: {run.stderr.strip()[-500:]}")
    os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide a prebuilt library from the image's other users
    os.replace(tmp, target)
    return target


def prebuild(folder: Path, variants: list[str] | None = None) -> list[Path]:
    """Compile every variant (or those of ``variants``) into ``folder`` (an image's build step:
    ``python -m kvfleet.kernels.cpu_lib --prebuild DIR [--variants a,b]``), whatever the build
    machine's CPU; each is opened once with ``ctypes`` and ABI-checked. ``$KVFLEET_KERNELS_DIR``
    pointed at ``folder`` makes :func:`load` use them without a compiler.

    Raises:
        ValueError: an unknown variant.
        OSError: no compiler, or a build or its check failed.
    """
    unknown = sorted(set(variants or ()) - set(VARIANT_FLAGS))
    if unknown:
        raise ValueError(f"unknown variant(s) {unknown}; the variants are {sorted(VARIANT_FLAGS)}")
    built = [build(variant, folder=Path(folder)) for variant in VARIANT_FLAGS if not variants or variant in variants]
    for path in built:
        check_abi(ctypes.CDLL(str(path)))
    return built


def check_abi(lib: ctypes.CDLL, structs: tuple[tuple[str, type[ctypes.Structure]], ...] | None = None) -> None:
    """Compare the library's struct sizes with the ctypes sizes of ``structs`` (None: :data:`STRUCTS`).

    Raises:
        AbiMismatch: a size differs (or the library does not export ``kv_abi_sizes``)."""
    fn = getattr(lib, "kv_abi_sizes", None)
    if fn is None:
        raise AbiMismatch("the library exports no kv_abi_sizes (a build older than kernels/cpu_lib.py)")
    fn.argtypes, fn.restype = [_ptr, _i64], _i64
    structs = STRUCTS if structs is None else structs
    sizes = (_i64 * len(structs))()
    count = fn(ctypes.addressof(sizes), len(structs))
    if count != len(structs):
        raise AbiMismatch(f"the library describes {count} structs, kernels/cpu_lib.py mirrors {len(structs)}")
    bad = [f"{name}: C {sizes[i]} bytes, ctypes {ctypes.sizeof(cls)}" for i, (name, cls) in enumerate(structs)
           if sizes[i] != ctypes.sizeof(cls)]
    if bad:
        raise AbiMismatch("C structs and their ctypes mirrors differ (" + "; ".join(bad) + ")")


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument and result types of every exported function; returns ``lib``."""
    p, i64 = _ptr, _i64
    for name, args, res in (
        ("kv_woq_int8_linear", [p, i64, i64, i64, p, i64, p, p, p], None),
        ("kv_woq_int4_linear", [p, i64, i64, i64, p, i64, p, p, i64, p, p], None),
        ("kv_woq_bf16_linear", [p, i64, i64, i64, p, i64, p, p], None),
        ("kv_woq_int8g_linear", [p, i64, i64, i64, p, i64, p, p, i64, p, p, i64, p], None),
        ("kv_woq_scaled_linear", [p, i64, i64, i64, i64, p, i64, p, p, i64, p, p, i64, p, p, i64, p], None),
        ("kv_woq_int4_dequant", [p, i64, i64, p, p, i64, p], None),
        ("kv_woq_int4_dequant_bf16", [p, i64, i64, p, p, i64, p], None),
        ("kv_woq_set_parallel_min", [i64], None),
        ("kv_amx_available", [], i64),
        ("kv_dpbf16_available", [], i64),
        ("kv_bf16_linear", [p, p, i64, i64, p, i64], i64),
        ("kv_pool_start", [i64, i64], i64),
        ("kv_decode_profile", [p], None),
        ("kv_decode", [p, i64, p, p, p, p, p, i64, p, p, p, p, i64], i64),
        ("kv_decode_profile_clock", [i64], None),   # (last: benchmarks bind older builds without it)
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def open_variant(variant: str, cache_root: Path | None = None) -> ctypes.CDLL:
    """Build (if needed), load, ABI-check and bind one variant, apart from the process's
    :func:`load` (tests of each variant). Only call its functions on a CPU that has the variant.

    Raises:
        OSError: the build or the load failed; :class:`AbiMismatch`."""
    lib = ctypes.CDLL(str(build(variant, cache_root)))
    check_abi(lib)
    bind(lib)
    lib.kv_woq_set_parallel_min(env.CPU_WOQ_PARALLEL_MIN.get())
    return lib


def load(cache_root: Path | None = None) -> ctypes.CDLL | None:
    """The process's library: the variant :func:`variant_for` names for this CPU, built once per
    cache folder; None when this machine cannot (the reason is logged once and kept in
    :func:`unavailable_reason`)."""
    global _lib, _variant, _error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None or _error is not None:
            return _lib
        try:
            features = cpu_features.detect()
        except ValueError as exc:  # a bad $KVFLEET_CPU_ISA
            _error = str(exc)
            logger.warning("kvfleet CPU kernels unavailable: %s", _error)
            return None
        variant = variant_for(features)
        if variant is None:
            _error = "the CPU lacks AVX2/FMA/F16C (or is not Linux x86-64)"
            return None
        try:
            lib = open_variant(variant, cache_root)
        except OSError as exc:  # AbiMismatch included
            if variant != "amx":
                _error = f"{variant} build: {exc}"
                logger.warning("kvfleet CPU kernels unavailable: %s", _error)
                return None
            # A compiler without -mamx-tile: the same CPU's avx512_bf16 kernels (no tiles).
            logger.warning("kvfleet CPU kernels: the amx build failed (%s); using avx512_bf16", exc)
            variant = "avx512_bf16"
            try:
                lib = open_variant(variant, cache_root)
            except OSError as exc2:
                _error = f"{variant} build: {exc2}"
                logger.warning("kvfleet CPU kernels unavailable: %s", _error)
                return None
        _lib, _variant = lib, variant
        logger.info("kvfleet CPU kernels: %s variant (%s)", variant, features.summary())
        return lib


def set_profile_clock(thread_cpu: bool) -> None:
    """The clock of the fused decoder's phase timers (``FusedDecoder.profile``): the calling thread's
    CPU time (``True``: with a pool of one thread, the whole step's work, less the time other
    processes took the core: the steadier measure on a shared machine) or wall time (``False``, the
    default). The process's library; it applies from the next step on.

    Raises:
        RuntimeError: the kernels are unavailable here."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"kvfleet CPU kernels unavailable: {unavailable_reason()}")
    lib.kv_decode_profile_clock(int(thread_cpu))


def available(cache_root: Path | None = None) -> bool:
    """Whether the kernels run on this machine (builds them on first call)."""
    return load(cache_root) is not None


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None when it has not or it succeeded)."""
    return _error


def loaded_variant() -> str | None:
    """The variant :func:`load` loaded (None before, or when unavailable)."""
    return _variant


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfleet.kernels.cpu_lib --prebuild DIR``: :func:`prebuild` into ``DIR``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvfleet.kernels.cpu_lib", description=main.__doc__)
    parser.add_argument("--prebuild", metavar="DIR", type=Path, required=True,
                        help="compile every ISA variant of the CPU kernels into DIR")
    parser.add_argument("--variants", default="", help="only these variants, comma-separated (default: all of "
                        + ", ".join(VARIANT_FLAGS) + ")")
    args = parser.parse_args(argv)
    wanted = [v for v in args.variants.split(",") if v]
    try:
        built = prebuild(args.prebuild, wanted or None)
    except ValueError as exc:
        parser.error(str(exc))
    for path in built:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
