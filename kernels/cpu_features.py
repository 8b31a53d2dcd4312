"""What this x86-64 CPU can run: its ``/proc/cpuinfo`` flags turned into the ISA levels that
kvfleet's CPU kernels are built for, and the facts the dtype choice needs.

Torch-free and pure: :meth:`CpuFeatures.from_cpuinfo` parses the text of ``/proc/cpuinfo``
(the first processor's ``model name`` and ``flags``), so the choice is unit-tested on recorded
flag sets (tests/data/cpuinfo/); :func:`detect` reads this machine's once.

ISA levels, lowest first (:data:`ISA_LEVELS`); each includes the ones before it:

- ``avx2``: AVX2 + FMA + F16C (Haswell, Zen 1 and later) -- kvfleet's floor for its C kernels;
- ``avx512``: AVX-512 F/BW/DQ/VL (Skylake-SP, Zen 4 and later);
- ``avx512_bf16``: ``avx512`` plus AVX512-BF16 (``vdpbf16ps``, ``vcvtne2ps2bf16``) and
  AVX512-VNNI (``vpdpbusd``) (Cooper Lake, Sapphire Rapids, Zen 4);
- ``amx``: ``avx512_bf16`` plus AMX tiles for bf16 and int8 (Sapphire Rapids and later).

``$KVFLEET_CPU_ISA`` (one of :data:`ISA_LEVELS`) caps the level :func:`detect` reports, to run a
lower path on a wider machine (A/B benchmarks, tests of the floor); it never raises a level the
CPU lacks.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

import kvfleet.runtime.env as env  # the settings registry: stdlib only, below every layer

ISA_ENV = env.CPU_ISA.name
ISA_LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")
"""kvfleet's CPU ISA levels, lowest first."""

_LEVEL_FLAGS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
"""The flags each level adds to the one below it (kernel names as ``/proc/cpuinfo`` spells them)."""

MATMUL_KERNELS = {"float32": "float32", "avx512_bf16": "AVX512-BF16 dot products (bf16)", "amx": "AMX tiles (bf16)"}
"""The one table of the fused decoder's matmul kernels (``kernels/cpu_decoder``), each as the
start-up lines name it: the float32 kernels (``cpu_gemv.h``, every level), and the bf16 kernels
of the levels named alike (``cpu_dpbf16.h``'s ``vdpbf16ps`` dot products, ``cpu_amx.h``'s tiles).
Which one runs is decided in two steps: the policy (the CPU plan, ``$KVFLEET_CPU_MATMUL``:
``runtime/worker/cpu_decode.matmul_asked``) and the capability (``cpu_decoder.resolve_matmul``:
the loaded library, the CPU, the matrices' shapes); the C step only re-checks that a thread may use
the AMX tiles."""


@dataclass(frozen=True)
class CpuFeatures:
    """One CPU's model name and ``/proc/cpuinfo`` flags, and what follows from them."""

    model_name: str
    flags: frozenset[str]
    x86_64: bool = True

    @classmethod
    def from_cpuinfo(cls, text: str, *, x86_64: bool = True) -> CpuFeatures:
        """Parse ``/proc/cpuinfo`` text: the first ``model name`` and the first ``flags`` line."""
        model, flags = "", None
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and flags is None:
                flags = frozenset(value.split())
        return cls(model, flags or frozenset(), x86_64)

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def isa_level(self) -> str | None:
        """The highest of :data:`ISA_LEVELS` whose flags (and those of every lower level) the CPU
        has; None below AVX2 or off x86-64 (kvfleet's C kernels then do not run)."""
        level = None
        if not self.x86_64:
            return None
        for name in ISA_LEVELS:
            if not self.has(*_LEVEL_FLAGS[name]):
                break
            level = name
        return level

    @property
    def native_bf16(self) -> bool:
        """Whether bf16 matrix products run natively (AVX512-BF16 or AMX-BF16); without it,
        torch's bf16 matmuls are emulated and slower than fp32."""
        return self.x86_64 and (self.has("avx512_bf16") or self.has("amx_bf16"))

    @property
    def int8_dot(self) -> str | None:
        """The integer dot-product instruction for u8 x s8 -> s32: ``avx512_vnni`` / ``avx_vnni``
        (``vpdpbusd``), ``avx2`` (``vpmaddubsw`` + ``vpmaddwd``), or None."""
        if not self.x86_64:
            return None
        if self.has("avx512_vnni") and self.has(*_LEVEL_FLAGS["avx512"]):
            return "avx512_vnni"
        if self.has("avx_vnni"):
            return "avx_vnni"
        return "avx2" if self.has("avx2") else None

    def capped(self, level: str | None) -> CpuFeatures:
        """These features with every flag above ``level`` removed (``level`` from
        :data:`ISA_LEVELS`; None keeps all)."""
        if level is None:
            return self
        if level not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_LEVELS)}; got {level!r}")
        above = ISA_LEVELS[ISA_LEVELS.index(level) + 1 :]
        drop = {f for name in above for f in _LEVEL_FLAGS[name]} | {"avx_vnni", "avx512_fp16"}
        if level == "avx2":
            drop |= {f for f in self.flags if f.startswith("avx512")}
        return CpuFeatures(self.model_name, self.flags - drop, self.x86_64)

    def summary(self) -> str:
        """One line for logs and benchmark records: model, ISA level, and the flags that matter."""
        keys = [f for name in ISA_LEVELS for f in _LEVEL_FLAGS[name]] + ["avx_vnni"]
        shown = " ".join(f for f in keys if f in self.flags)
        return f"{self.model_name or 'unknown CPU'} [level {self.isa_level}; {shown or 'no AVX2'}]"


@functools.cache
def _read_machine() -> CpuFeatures:
    x86 = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return CpuFeatures.from_cpuinfo(text, x86_64=x86)


def detect() -> CpuFeatures:
    """This machine's features (read once), capped by ``$KVFLEET_CPU_ISA`` when set.

    Raises:
        ValueError: ``$KVFLEET_CPU_ISA`` is not one of :data:`ISA_LEVELS`.
    """
    return _read_machine().capped(env.CPU_ISA.raw())
