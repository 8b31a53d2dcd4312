"""What a benchmark records about the machine it ran on: the CPU's name and core count
(:func:`cpu_description`, one line for every report) and the ISA flags, cores and memory that
decide each system's best dtype and kernels (:func:`machine`, ``kvfleet bench peers``).

Reads ``/proc/cpuinfo`` and ``os.sysconf``; no torch, no kvfleet import, so ``benchmarks/``
scripts and every ``kvfleet bench`` command share it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_description() -> str:
    """CPU model name (``/proc/cpuinfo``) and logical core count."""
    name = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical cores"


def machine() -> dict:
    """CPU model, the ISA flags of :data:`ISA_FLAGS` it has, cores, memory (GiB), load average."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"cpu": cpu_description(), "flags": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count(),
            "memory_gib": round(mem / 2**30, 1), "load_average_start": os.getloadavg()[0]}
