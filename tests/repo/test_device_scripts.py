"""benchmarks/device/: the scripts that run the GPU check in one call of the device tool.

Without a GPU: truncate_gguf.py on the real default model, summarize.py on the JSON of real
``gpu_check.py --smoke`` processes, and run.sh end to end in smoke mode (every section on
CPU under the Triton interpreter, the engine section on a 2-layer cut of the real model).
prepare.sh downloads from PyPI (89 MiB) and is not run here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import ROOT

DEVICE = ROOT / "benchmarks" / "device"
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, DEVICE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVFLEET_ATTENTION_BACKEND")}
    e.update(PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", **extra)
    return e


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory) -> Path:
    from kvfleet.runtime.worker.model_loader import default_model_path

    dst = tmp_path_factory.mktemp("model") / "smollm2-first2.gguf"
    load("truncate_gguf").truncate(default_model_path(), dst, 2)
    return dst


def test_truncate_gguf_keeps_the_first_layers_byte_for_byte(two_layer_model):
    import gguf

    from kvfleet.runtime.worker.model_loader import default_model_path

    src = gguf.GGUFReader(str(default_model_path()))
    out = gguf.GGUFReader(str(two_layer_model))
    assert src.fields["llama.block_count"].contents() == 30
    assert out.fields["llama.block_count"].contents() == 2
    names = [t.name for t in out.tensors]
    assert any(n.startswith("blk.1.") for n in names)
    assert not any(n.startswith("blk.2.") for n in names)
    assert "token_embd.weight" in names and "output_norm.weight" in names
    by_name = {t.name: t for t in src.tensors}
    for t in out.tensors:
        assert t.tensor_type == by_name[t.name].tensor_type
        assert bytes(t.data.tobytes()) == bytes(by_name[t.name].data.tobytes()), t.name
    # everything but the layer count travels unchanged: tokenizer, chat template
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "llama.attention.head_count_kv"):
        assert out.fields[key].contents() == src.fields[key].contents()


def test_truncate_gguf_refuses_more_layers_than_the_model_has(tmp_path):
    from kvfleet.runtime.worker.model_loader import default_model_path

    r = subprocess.run([sys.executable, str(DEVICE / "truncate_gguf.py"), str(default_model_path()),
                        str(tmp_path / "x.gguf"), "--layers", "31"], capture_output=True, text=True,
                       timeout=300, env=env())
    assert r.returncode != 0
    assert "--layers 31: the model has 30 layers" in r.stderr


@pytest.fixture(scope="module")
def run_sh(tmp_path_factory, two_layer_model):
    """run.sh end to end in smoke mode, once for the module: ``(completed process, OUT, WORK_DIR)``."""
    tmp = tmp_path_factory.mktemp("run_sh")
    out, work = tmp / "out", tmp / "work"
    r = subprocess.run(
        ["bash", str(DEVICE / "run.sh")], capture_output=True, text=True, timeout=900, cwd=tmp,
        env=env(OUT=str(out), WORK_DIR=str(work), PYTHON=sys.executable, SITE=str(tmp / "site"), SHARDS="2",
                WHEELS_DIR=str(tmp / "no-wheels"), ENGINE_MODEL=str(two_layer_model),
                KVFLEET_CACHE_DIR=str(tmp / "cache"), GPU_CHECK_EXTRA_ARGS="--smoke --engine-max-tokens 3"),
    )
    return r, out, work


@pytest.mark.slow
def test_summarize_merges_shards_and_reports_a_killed_one(tmp_path, run_sh):
    """On the shard files of run.sh's two real ``gpu_check.py --smoke`` correctness processes."""
    _, _, work = run_sh
    for k in (0, 1):
        src = work / f"correctness.{k}.json"
        assert src.is_file(), f"run.sh left no {src.name}"
        (tmp_path / src.name).write_text(src.read_text())
    (tmp_path / "shards").write_text("2")
    summarize = load("summarize")
    merged = summarize.merge(tmp_path)
    corr = merged["sections"]["correctness"]
    assert corr["status"] == "pass" and corr["shards"] == 2
    single = json.loads((tmp_path / "correctness.0.json").read_text())["sections"]["correctness"]
    assert corr["checks"] == corr["passed"] > single["checks"] > 0  # both shards counted
    assert merged["versions"]["triton"]
    # the engine was asked for (its status file exists) but wrote nothing: a failure, not a pass
    (tmp_path / "engine.status").write_text("1")
    assert summarize.merge(tmp_path)["ok"] is False
    (tmp_path / "engine.status").unlink()
    # a shard killed at its limit (timeout's 124) leaves no JSON: the section fails and says why
    (tmp_path / "correctness.1.json").unlink()
    (tmp_path / "correctness.1.status").write_text("124")
    merged = summarize.merge(tmp_path)
    assert merged["sections"]["correctness"]["status"] == "fail"
    assert any("killed at its time limit" in f for f in merged["sections"]["correctness"]["failures"])
    assert merged["ok"] is False
    assert summarize.main([str(tmp_path), str(tmp_path / "summary.json")]) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is False


@pytest.mark.slow
def test_run_sh_smoke_end_to_end(run_sh):
    r, out, _ = run_sh
    tmp_path = out.parent
    assert r.returncode == 0, r.stdout[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True
    assert {k: v["status"] for k, v in summary["sections"].items()} == dict(
        correctness="pass", engine="pass", decode="pass", prefill="pass")
    engine = summary["sections"]["engine"]
    assert engine["compared"] == ["cpu (triton backend)", "cpu (torch backend)"]
    assert all(p["same"] and p["logprobs_compared"] > 0 for p in engine["prompts"])
    log = (out / "gpu_check.log").read_text()
    assert log == r.stdout  # the log holds everything printed
    assert f"import kvfleet.kernels:  {tmp_path / 'site'}/kvfleet/kernels/__init__.py" in log
    assert "=> OK" in log
    assert sorted(p.name for p in out.iterdir()) == [
        "decode.json", "engine.json", "gpu_check.log", "prefill.json", "summary.json"]
