"""The termination log (kvfleet.runtime.entrypoints.openai.lifecycle): one line for the kubelet,
a model load error's reason first so the operator can name it in a condition."""

from __future__ import annotations

from kvfleet.runtime.entrypoints.openai import lifecycle
from kvfleet.runtime.model_errors import INVALID_MODEL_FILE, ModelLoadError, reason_of


def test_a_model_load_error_writes_its_reason_first(tmp_path):
    err = ModelLoadError(INVALID_MODEL_FILE, "/models/m.gguf", "truncated: 12 of 4096 bytes of tensor\nblk.0")
    log = tmp_path / "termination-log"
    assert lifecycle.write_termination_log(str(log), err)
    text = log.read_text()
    assert text == "InvalidModelFile: /models/m.gguf: truncated: 12 of 4096 bytes of tensor blk.0"
    assert reason_of(text) == INVALID_MODEL_FILE


def test_other_errors_keep_the_engine_died_line():
    assert lifecycle.termination_message(ValueError("bad")) == "the engine died: builtins.ValueError: bad"
    assert reason_of(lifecycle.termination_message(ValueError("InvalidModelFile: x"))) is None
    assert lifecycle.termination_message(MemoryError("x")).startswith("out of memory: ")
