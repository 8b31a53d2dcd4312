"""Where a LoRA adapter's files are: ``lora_path`` as a folder, ``file:///PATH``, or ``hf://ORG/NAME[@REV]``.

An ``hf://`` adapter is fetched into ``$KVFLEET_CACHE_DIR/lora/ORG--NAME@REV`` (default cache dir
``~/.cache/kvfleet``) by the same fetcher as the operator's model init container
(``python -m kvfleet.operator.fetch``, run as a child process: retries, a per-attempt timeout,
a lock shared by processes using one volume, a completion marker), only its
``adapter_config.json`` and ``adapter_model.safetensors``, with the hub reachable for that
process even where the server runs with ``HF_HUB_OFFLINE=1`` (the operator's pods do). Torch-free;
blocking (call it off the event loop).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvfleet.runtime import env

LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")
FETCH_TIMEOUT = env.LORA_FETCH_TIMEOUT.get()
"""Seconds one download attempt of an ``hf://`` adapter may take."""


def lora_cache_dir() -> Path:
    return env.CACHE_DIR.get() / "lora"


def resolve_lora_path(path: str) -> str:
    """A local folder for ``path``.

    Raises:
        LoRALoadError: a malformed ``hf://`` URI, or its download failed (the fetcher's last lines)."""
    from kvfleet.runtime.lora_request import LoRALoadError

    if path.startswith("file://"):
        return "/" + path[len("file://"):].lstrip("/")
    if not path.startswith("hf://"):
        return path
    repo, _, revision = path[len("hf://"):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise LoRALoadError(f"lora_path {path!r}: an hf:// adapter is hf://ORG/NAME[@REVISION]")
    dest = lora_cache_dir() / f"{repo}@{revision or 'main'}".replace("/", "--")
    cmd = [sys.executable, "-m", "kvfleet.operator.fetch", "--repo", repo, "--dest", str(dest),
           "--timeout", str(FETCH_TIMEOUT), "--retries", "2"]
    if revision:
        cmd += ["--revision", revision]
    for name in LORA_FILES:
        cmd += ["--allow-pattern", name]
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=FETCH_TIMEOUT * 2 + 60)
    if proc.returncode != 0:
        tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
        raise LoRALoadError(f"lora_path {path!r}: download failed: {tail}")
    return str(dest)
