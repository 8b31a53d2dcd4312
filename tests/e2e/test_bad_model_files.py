"""`kvfleet serve --model BAD.gguf`: a file with the wrong magic, a truncated one, one with an unknown
tensor type and one of an architecture nobody maps each end the server with exit status 1 and one
ERROR line that names the file and the reason (no traceback); so does a hub id that cannot be
fetched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.slow


def _write(path: Path, arch: str) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    good = _write(tmp / "good.gguf", "llama").read_bytes()
    (tmp / "magic.gguf").write_bytes(b"GGML" + good[4:])
    (tmp / "cut.gguf").write_bytes(good[:40])
    data = bytearray(good)
    at = data.find(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 2 * 8  # n_dims, two dims, then the type
    data[at:at + 4] = (99).to_bytes(4, "little")
    (tmp / "type.gguf").write_bytes(bytes(data))
    _write(tmp / "arch.gguf", "xyzzy")
    return {
        "wrong magic": (tmp / "magic.gguf", "not a GGUF file (magic"),
        "truncated": (tmp / "cut.gguf", "truncated or unreadable GGUF header"),
        "unknown tensor type": (tmp / "type.gguf", "99"),
        "no architecture mapping": (tmp / "arch.gguf", "architecture 'xyzzy'"),
    }


@pytest.mark.parametrize("case", ["wrong magic", "truncated", "unknown tensor type", "no architecture mapping"])
def test_a_bad_gguf_file_is_one_error_line_and_exit_1(case, tmp_path):
    path, reason = _bad_files(tmp_path)[case]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVFLEET_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--model", str(path), "--port", "0",
                           "--host", "127.0.0.1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr[-3000:]
    assert str(path) in errors[0] and reason in errors[0], errors[0]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_hub_id_that_cannot_be_fetched_is_one_error_line_and_exit_1(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--model", "some-org/not-a-model",
                           "--port", "0", "--host", "127.0.0.1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "some-org/not-a-model" in errors[0] and "OSError" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
