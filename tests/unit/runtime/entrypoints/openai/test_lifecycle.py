"""The termination log (kvfleet.runtime.entrypoints.openai.lifecycle): one line for the kubelet,
a model load error's reason first so the operator can name it in a condition."""

from __future__ import annotations

import pytest

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


def test_a_bad_gguf_file_or_packed_checkpoint_writes_its_reason_first(tmp_path):
    """The readers' own errors (GgufError, PackedError) carry a reason too, so the operator shows a
    bad file as a condition (they were 'the engine died: ...GgufError: ...', no reason)."""
    import types

    import gguf
    import numpy as np

    from kvfleet.runtime.model_errors import UNSUPPORTED_ARCHITECTURE, UNSUPPORTED_QUANTIZATION
    from kvfleet.runtime.worker import model_loader, packed_checkpoints
    from kvfleet.runtime.worker.gguf_header import GgufError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"XXXX" + bytes(64))
    unknown = tmp_path / "frob.gguf"
    w = gguf.GGUFWriter(str(unknown), "frobnicator")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    want = {bad: INVALID_MODEL_FILE, unknown: UNSUPPORTED_ARCHITECTURE}
    for path, reason in want.items():
        with pytest.raises(GgufError) as exc:
            model_loader.load_model(str(path), device="cpu", cache_root=tmp_path / "cache")
        text = lifecycle.termination_message(exc.value)
        assert reason_of(text) == reason and str(path) in text, text
    with pytest.raises(packed_checkpoints.PackedError) as exc:
        packed_checkpoints.method_of(types.SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 8}),
                                     "/models/m")
    text = lifecycle.termination_message(exc.value)
    assert text.startswith("UnsupportedQuantization: /models/m: GPTQ") and reason_of(text) == UNSUPPORTED_QUANTIZATION
