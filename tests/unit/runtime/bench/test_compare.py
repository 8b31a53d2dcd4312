"""``kvfleet bench compare``: workload FLOPs, KV-memory report, workloads and datasets;
and (slow) one tiny real comparison of all three systems."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvfleet.runtime.bench import datasets as ds
from kvfleet.runtime.bench.datasets import Workload, make_workload, parse_range
from kvfleet.runtime.bench.roofline import ModelShape, kv_memory_report, roofline, workload_flops

SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152)


def test_model_shape_of_smollm2():
    s = ModelShape.from_config(SMOLLM2)
    # K and V, 30 layers, 3 KV heads of 64, fp32
    assert s.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46080
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert s.linear_flops_per_token == 2 * 30 * per_layer
    assert s.lm_head_flops == 2 * 576 * 49152
    assert s.attention_flops_per_key == 4 * 30 * 9 * 64


def test_workload_flops_by_hand():
    s = ModelShape(hidden_size=2, intermediate_size=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, vocab_size=10)
    lin = s.linear_flops_per_token
    assert lin == 2 * (2 * 2 + 2 * 2 + 2 * 2 + 2 * 2 + 3 * 2 * 4)
    head, att = 2 * 2 * 10, 4 * 2
    pre, dec = workload_flops([3], [4], s)
    # prefill: 3 tokens, attention over 1+2+3 keys, one LM head
    assert pre == 3 * lin + att * 6 + head
    # decode: 3 forward tokens at positions 3, 4, 5 attending to 4, 5, 6 keys, 3 LM heads
    assert dec == 3 * (lin + head) + att * (4 + 5 + 6)
    # one output token: no decode work
    assert workload_flops([5], [1], s)[1] == 0
    r = roofline(Workload([[1, 2, 3]], [4]), s, peak_flops_per_s=(pre + dec) / 3)
    assert r.gflop == pytest.approx((pre + dec) / 1e9)
    assert r.seconds == pytest.approx(3.0)
    assert r.output_tokens_per_s == pytest.approx(4 / 3)


def test_kv_memory_report_by_hand():
    rows = kv_memory_report([10, 30, 5, 40], [6, 2, 20, 40], block_size=16, max_model_len=128,
                            kv_bytes_per_token=100, kv_budget_bytes=100 * 1024, static_batch=2)
    paged, reserve, static = rows
    real = 16 + 32 + 25 + 80
    assert all(r["real_tokens"] == real for r in rows)
    # paged: 1 + 2 + 2 + 5 blocks of 16
    assert paged["allocated_slots"] == 160
    assert paged["utilization"] == pytest.approx(real / 160)
    # 1024 slots = 64 blocks; a mean sequence takes 2.5 blocks -> 25 sequences
    assert paged["max_concurrent_seqs"] == 25
    assert reserve["allocated_slots"] == 4 * 128
    assert reserve["max_concurrent_seqs"] == 1024 // 128
    # static batches [0,1]: 30 + 6 = 36 each; [2,3]: 40 + 40 = 80 each
    assert static["allocated_slots"] == 2 * 36 + 2 * 80
    assert static["max_concurrent_seqs"] == int(1024 // 58)
    assert paged["utilization"] > static["utilization"] > reserve["utilization"]
    with pytest.raises(ValueError):
        kv_memory_report([100], [100], 16, 128, 100, 10_000, 1)


def test_workloads_are_seeded_and_in_range():
    a = make_workload(50, (16, 256), (16, 128), vocab_size=1000, special_ids=[0, 1, 2], seed=3)
    b = make_workload(50, (16, 256), (16, 128), vocab_size=1000, special_ids=[0, 1, 2], seed=3)
    assert a.prompts == b.prompts and a.output_lens == b.output_lens
    assert all(16 <= len(p) <= 256 for p in a.prompts)
    assert all(16 <= o <= 128 for o in a.output_lens)
    assert not {0, 1, 2} & {t for p in a.prompts for t in p}
    assert a.take(10).prompts == a.prompts[:10]
    assert parse_range("16:256") == (16, 256) and parse_range("8") == (8, 8)
    for bad in ("0:5", "9:3", "a:b"):
        with pytest.raises(ValueError):
            parse_range(bad)


@pytest.fixture(scope="module")
def tokenizer():
    from kvfleet.runtime.bench.serve import load_tokenizer

    return load_tokenizer(None)


def test_random_dataset_has_exact_token_lengths(tokenizer):
    reqs = ds.random_dataset(tokenizer, 12, input_len=64, output_len=32, range_ratio=0.5, seed=1)
    assert len(reqs) == 12
    for r in reqs:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 32 <= r.prompt_len <= 96 and 16 <= r.expected_output_len <= 48
    assert len({r.prompt_len for r in reqs}) > 1
    again = ds.random_dataset(tokenizer, 12, input_len=64, output_len=32, range_ratio=0.5, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_shared_prefix_dataset(tokenizer):
    reqs = ds.shared_prefix_dataset(tokenizer, 5, prefix_len=100, input_len=20, output_len=8, seed=0)
    assert len({r.system for r in reqs}) == 1
    assert len(tokenizer.encode(reqs[0].system, add_special_tokens=False)) == 100
    assert len({r.prompt for r in reqs}) == 5
    assert all(r.completion_prompt().startswith(reqs[0].system) for r in reqs)
    assert reqs[0].chat_messages()[0] == {"role": "system", "content": reqs[0].system}


def test_sharegpt_from_file_and_synthetic(tokenizer, tmp_path):
    convs = [
        {"conversations": [{"from": "human", "value": "Tell me about the river Seine and Paris."},
                           {"from": "gpt", "value": "The Seine flows through Paris, the capital of France, to the sea."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Hello there, how can I help?"}]},  # prompt < 4 tokens
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = ds.sharegpt_dataset(tokenizer, 1, str(path), seed=0)
    assert reqs[0].prompt.startswith("Tell me about")
    assert reqs[0].expected_output_len == len(tokenizer.encode(convs[0]["conversations"][1]["value"], add_special_tokens=False))
    with pytest.raises(ValueError):
        ds.sharegpt_dataset(tokenizer, 2, str(path))
    lengths = ds.synthetic_sharegpt_lengths(4000, seed=0)
    p = np.array([a for a, _ in lengths])
    o = np.array([b for _, b in lengths])
    assert np.median(p) == pytest.approx(ds.SYNTHETIC_SHAREGPT_PROMPT[0], rel=0.1)
    assert np.median(o) == pytest.approx(ds.SYNTHETIC_SHAREGPT_OUTPUT[0], rel=0.1)
    assert p.min() >= 4 and p.max() <= 1024 and o.min() >= 4 and (p + o).max() <= 2048
    synth = ds.sharegpt_dataset(tokenizer, 6, None, seed=0)
    assert [r.expected_output_len for r in synth] == [b for _, b in ds.synthetic_sharegpt_lengths(6, seed=0)]


@pytest.mark.slow
def test_compare_runs_all_three_systems(tmp_path):
    """A tiny real comparison: every system serves the same requests with the same output
    lengths, and the JSON report carries throughputs, the roofline and the KV report."""
    out = tmp_path / "compare.json"
    plot = tmp_path / "compare.png"
    proc = subprocess.run(
        [sys.executable, "-m", "kvfleet.runtime.cli", "bench", "compare", "--concurrency", "2", "--num-prompts", "3",
         "--input-len-range", "8:24", "--output-len-range", "2:6", "--kv-report-requests", "50", "--prefill-tokens", "64",
         "--output-json", str(out), "--plot", str(plot), "--disable-tqdm"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    runs = doc["levels"]["2"]["runs"]
    assert [r["system"] for r in runs] == ["kvfleet", "hf-static", "hf-continuous"]
    totals = {r["total_output_tokens"] for r in runs}
    assert len(totals) == 1 and totals.pop() > 0
    for r in runs:
        assert r["error"] is None and r["completed"] == 3 and r["failed"] == 0
        assert r["output_throughput"] > 0 and r["p99_e2el_ms"] > 0
    roof = doc["levels"]["2"]["roofline"]
    assert roof["output_tokens_per_s"] > 0 and math.isfinite(roof["seconds"])
    assert [row["scheme"].split()[0] for row in doc["kv_memory"]] == ["paged", "reserve", "static"]
    assert "| kvfleet (continuous, paged) |" in proc.stdout and "compute roofline" in proc.stdout
    assert plot.stat().st_size > 10_000


def test_lognormal_lengths_are_heavy_tailed_and_clipped():
    from kvfleet.runtime.bench.datasets import sample_lengths

    p, o = sample_lengths(5000, (16, 256), (8, 256), seed=0, dist="lognormal", sigma=1.0)
    assert p.min() >= 16 and p.max() == 256 and o.min() >= 8 and o.max() == 256
    assert np.median(p) == pytest.approx(64, rel=0.08)  # sqrt(16 * 256)
    assert np.median(o) == pytest.approx(np.sqrt(8 * 256), rel=0.08)
    assert p.mean() > np.median(p)  # right-skewed
    u, _ = sample_lengths(5000, (16, 256), (8, 256), seed=0)
    assert abs(np.median(u) - 136) < 10
    with pytest.raises(ValueError):
        sample_lengths(3, (1, 2), (1, 2), dist="zipf")


def test_static_batch_flops_pads_to_the_batch_maximum():
    from kvfleet.runtime.bench.roofline import static_batch_flops

    s = ModelShape.from_config(SMOLLM2)
    p, o = [10, 30, 5, 40], [6, 2, 20, 40]
    padded = sum(workload_flops([30, 30], [6, 6], s)) + sum(workload_flops([40, 40], [40, 40], s))
    assert static_batch_flops(p, o, 2, s) == pytest.approx(padded)
    assert static_batch_flops(p, o, 1, s) == pytest.approx(sum(workload_flops(p, o, s)))
    assert static_batch_flops(p, o, 4, s) > static_batch_flops(p, o, 2, s) > sum(workload_flops(p, o, s))


def test_source_revision_names_this_checkout():
    import re
    import shutil
    from pathlib import Path

    import kvfleet.runtime.bench.serve as mod
    from kvfleet.runtime.bench.serve import source_revision

    rev = source_revision()
    in_git = shutil.which("git") and any((p / ".git").exists() for p in Path(mod.__file__).resolve().parents)
    if not in_git:
        assert rev is None
        return
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(mod.__file__).parent, capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", rev) and rev.startswith(head)
