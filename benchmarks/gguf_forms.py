"""Speed of a GGUF model in the compact weight forms (float16 group scales, Q5_0's 5-bit form: issue
41) against the same weights in the earlier forms (int8 weights, float32 scales), one engine per
form, alternated in one run so a shared machine's load hits both alike. Not a test::

    python benchmarks/gguf_forms.py [--rounds 2] [FILE.gguf]   (default: /work/gemma/gemma-3-270m-q4_k_m.gguf)
    python benchmarks/gguf_forms.py --matrices
    python benchmarks/gguf_forms.py --sweep [L]
    OMP_NUM_THREADS=1 python benchmarks/gguf_forms.py --cstep [FILE.gguf]

``--matrices``: the kernels alone, per matrix (Gemma 3 270M's q|k|v and gate|up in Q5_0, its
262144 x 640 Q8_0 head; random blocks), compact against plain form on each matmul kind the loaded
library and the CPU have (float32, AMX tiles, AVX512-BF16 dot products), at 1 and 48 rows: the
best ms of 7 rounds (`$ROUNDS`) of 3 calls, the two forms alternated round by round. ``--sweep``:
``L`` (24) Gemma gate|up matrices [4096, 640] in Q5_0 (63 M weights: out of cache, as a decode
step reads them) run one after the other, compact against plain, on each kind at 1 and 48 rows:
the best of 9 sweeps. ``--cstep``: the model's fused C step (one thread, its CPU time), the
K-quants' factored scales against the same matrices with float32 scales, alternated round by round
(``$ROUNDS``, 10, of 4 steps) at 1 and 48 rows, on the matmul kinds the plan picks
(``$KVFLEET_CPU_MATMUL`` to choose); the logits of both compared bit for bit.

Each measurement is a fresh process (``--dtype auto``: the GGUF reader; an empty
``$KVFLEET_CACHE_DIR``), the "plain" one with the loader's ``from_gguf`` results taken through
``Stored.plain()`` (the forms before issue 41's compact ones). The workload is
``benchmarks/step_profile.py``'s: one stream (128-token prompt, 256 new tokens; decode tok/s and
the median step, one row) and 48 requests at once (prompts 16-400 tokens, outputs 16-150, seed 0;
output tok/s, and the median step that returned 48 outputs: a decode step of 48 rows). Greedy, EOS
ignored: both forms must give the same tokens (the same float32 weights, the same sums). Prints the
best of the rounds per form and compact / plain. Results: docs/performance.md, "GGUF files as
stored".
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
DEFAULT = "/work/gemma/gemma-3-270m-q4_k_m.gguf"


def _plain_loader() -> None:
    """The loader's compact forms undone (``Stored.plain``), where it is called from."""
    from kvfleet.runtime.worker import gguf_header, gguf_tensors

    original = gguf_tensors.from_gguf

    def plain(*args, **kwargs):
        return original(*args, **kwargs).plain()

    gguf_tensors.from_gguf = plain
    gguf_header.from_gguf = plain


def child(path: str, form: str) -> dict:
    import torch
    from step_profile import one_stream, warmed_engine, workload_48

    from kvfleet.runtime.sampling_params import SamplingParams

    if form == "plain":
        _plain_loader()
    eng = warmed_engine("auto", model=path)
    one = one_stream(eng)
    work = workload_48()
    for i, (p, m) in enumerate(work):
        eng.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    finals, at48 = {}, []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - s0
        if len(outs) == 48:
            at48.append(dt)
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
    dt = time.perf_counter() - t0
    total = sum(len(o.outputs[0].token_ids) for o in finals.values())
    many = {"output_tok_s": total / dt, "step48_ms": 1e3 * statistics.median(at48) if at48 else float("nan"),
            "token_ids": {k: finals[k].outputs[0].token_ids for k in sorted(finals)}}
    return {"form": form, "threads": torch.get_num_threads(), "one": one,
            "many": many}


def matrices() -> None:
    import ctypes

    import numpy as np
    import torch
    from matrix_kinds import best_ms

    from kvfleet.kernels import cpu_features, cpu_lib
    from kvfleet.runtime.worker.gguf_tensors import from_gguf

    lib = cpu_lib.load()
    kinds = {"float32": 0}
    if lib.kv_amx_available() == 1:
        kinds["amx"] = 1
    if lib.kv_dpbf16_available() == 1:
        kinds["avx512_bf16"] = 2
    rng = np.random.default_rng(0)
    print(f"CPU: {cpu_features.detect().summary()}; variant {cpu_lib.loaded_variant()}; "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}")
    print("| matrix | kind | rows | compact ms | plain ms | compact / plain |")
    print("|---|---|---:|---:|---:|---:|")
    for name, qtype, N, K in (("q|k|v", 6, 1536, 640), ("gate|up", 6, 4096, 640), ("head", 8, 262144, 640)):
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
        raw[..., :2] = (rng.random((N, K // block, 1)) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8)
        compact = from_gguf(qtype, raw.reshape(N, -1), (N, K))
        del raw
        plain = compact.plain()
        mats = []
        for s in (compact, plain):
            ptr = (lambda t: None if t is None else t.data_ptr())
            mats.append(cpu_lib.Matrix(4, N, K, s.w.data_ptr(), ptr(s.scale), ptr(s.shift), s.group, None,
                                       scale_f16=int(s.scale.dtype == torch.float16), hbits=ptr(s.high)))
        x = torch.randn(48, K)
        y = torch.empty(48, N)
        for kind, code in kinds.items():
            for M in (1, 48):
                call = [partial(lib.kv_bf16_linear, ctypes.byref(m), x.data_ptr(), M, K, y.data_ptr(), code)
                        for m in mats]
                best = [float("inf"), float("inf")]
                for _ in range(int(os.environ.get("ROUNDS", "7"))):
                    for i in (0, 1):
                        best[i] = min(best[i], best_ms(call[i], rounds=1, calls=3))
                print(f"| {name} [{N}, {K}] {compact.source} | {kind} | {M} | {best[0]:.3f} | {best[1]:.3f} | "
                      f"{best[0] / best[1]:.2f} |", flush=True)
        del compact, plain, mats


def sweep(count: int) -> None:
    import ctypes

    import gguf
    import numpy as np
    import torch

    from kvfleet.kernels import cpu_features, cpu_lib
    from kvfleet.runtime.worker.gguf_tensors import from_gguf

    lib = cpu_lib.load()
    kinds = {"float32": 0, **({"amx": 1} if lib.kv_amx_available() == 1 else {}),
             **({"avx512_bf16": 2} if lib.kv_dpbf16_available() == 1 else {})}
    rng = np.random.default_rng(0)
    N, K = 4096, 640
    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q5_0]
    forms: dict[str, list] = {"compact": [], "plain": []}
    for _ in range(count):
        raw = rng.integers(0, 256, (N, K // 32, size), dtype=np.uint8)
        raw[..., :2] = (rng.random((N, K // 32, 1)) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8)
        c = from_gguf(gguf.GGMLQuantizationType.Q5_0, raw.reshape(N, -1), (N, K))
        for name, s in (("compact", c), ("plain", c.plain())):
            ptr = (lambda t: None if t is None else t.data_ptr())
            forms[name].append((s, cpu_lib.Matrix(4, N, K, s.w.data_ptr(), ptr(s.scale), None, 32, None,
                                                  scale_f16=int(s.scale.dtype == torch.float16),
                                                  hbits=ptr(s.high))))
    x, y = torch.randn(48, K), torch.empty(48, N)
    print(f"CPU: {cpu_features.detect().summary()}; variant {cpu_lib.loaded_variant()}; "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f}; {count} x Q5_0 [{N}, {K}]")
    print("| kind | rows | compact ms | plain ms | compact / plain |")
    print("|---|---:|---:|---:|---:|")
    for kind, code in kinds.items():
        for M in (1, 48):
            best = {"compact": float("inf"), "plain": float("inf")}
            for _ in range(9):
                for name, mats in forms.items():
                    t0 = time.perf_counter()
                    for _, m in mats:
                        lib.kv_bf16_linear(ctypes.byref(m), x.data_ptr(), M, K, y.data_ptr(), code)
                    best[name] = min(best[name], time.perf_counter() - t0)
            print(f"| {kind} | {M} | {best['compact'] * 1e3:.2f} | {best['plain'] * 1e3:.2f} | "
                  f"{best['compact'] / best['plain']:.2f} |", flush=True)


def _float32_scales(m):
    """A fused-decoder matrix with factored scales (GGUF K-quants) as float32 products, and int4's float16
    ones (Q4_0 / Q4_1) as float32 (the forms before them: the same float32 scales, 4 bytes a group);
    others as they are."""
    import dataclasses

    import torch

    from kvfleet.kernels.cpu_woq import group_scales

    if m is None or (m.scale_d is None and not (m.fmt == "int4" and m.scale.dtype == torch.float16)):
        return m
    return dataclasses.replace(m, scale=group_scales(m.scale, m.scale_d).contiguous(), scale_d=None,
                               shift=None if m.shift is None else group_scales(m.shift, m.shift_d).contiguous(),
                               shift_d=None)


def cstep(path: str, rounds: int, steps: int) -> None:
    """The fused C step of ``path``'s model (one thread: the phases in its CPU time), its factored K-quant
    scales and int4 float16 ones against the same matrices with float32 scales, alternated round by
    round, at 1 and 48 rows (context 140, a bf16 cache of random keys and values); logits compared bit
    for bit."""
    import dataclasses

    import torch

    torch.set_num_threads(1)
    from step_profile import make_engine

    from kvfleet.kernels.cpu_decoder import FusedDecoder

    eng = make_engine("auto", model=path)
    base = eng.runner.cpu_decode._fused
    w, bs, ctx = base.weights, 16, 140
    gen = torch.Generator().manual_seed(0)
    width = (ctx + bs - 1) // bs
    blocks = 48 * width + 1
    layers = {"factored": [], "float32": []}
    for layer in w.layers:
        shape = (blocks, bs, *layer.k_cache.shape[2:])
        kv = dict(k_cache=torch.randn(shape, generator=gen).to(torch.bfloat16),
                  v_cache=torch.randn(shape, generator=gen).to(torch.bfloat16))
        layers["factored"].append(dataclasses.replace(layer, **kv))
        layers["float32"].append(dataclasses.replace(layer, **kv, **{f: _float32_scales(getattr(layer, f))
                                                                    for f in ("qkv", "o", "gate_up", "down")}))
    head = {"factored": w.head, "float32": _float32_scales(w.head)}
    decs = {k: FusedDecoder(dataclasses.replace(w, layers=v, head=head[k]), matmul=base.matmul)
            for k, v in layers.items()}
    for d in decs.values():
        d._lib.kv_decode_profile_clock(1)
    factored = sum(_float32_scales(m) is not m for lay in w.layers for m in (lay.qkv, lay.o, lay.gate_up, lay.down))
    print(f"CPU load average {os.getloadavg()[0]:.1f}; matmul {base.matmul}; {factored} matrices factored or int4 "
          "float16; "
          f"{rounds} rounds x {steps} steps; thread CPU ms per step (the C phases' sum)")
    for rows in (1, 48):
        tables = torch.randperm(blocks - 1, generator=gen)[: rows * width].view(rows, width).to(torch.int32)
        lens = torch.full((rows,), ctx, dtype=torch.int32)
        slots = torch.full((rows,), -1, dtype=torch.int64)
        d0 = decs["factored"]
        table = (d0.num_ropes, rows, d0.rotary_dim) if d0.num_ropes > 1 else (rows, d0.rotary_dim)
        cos, sin = torch.ones(table), torch.zeros(table)
        x = torch.randn(rows, decs["factored"].hidden, generator=gen)
        per, logits = {k: [] for k in decs}, {}
        for r in range(rounds):
            for k in (list(decs) if r % 2 == 0 else list(decs)[::-1]):
                decs[k].profile()
                for _ in range(steps):
                    _, logits[k] = decs[k].step(x.clone(), cos, sin, slots, tables, lens)
                prof = decs[k].profile()
                per[k].append({p: v for p, v in prof.items() if p != "steps"})
        for k, ps in per.items():
            med = {p: statistics.median(q[p] for q in ps) for p in ps[0]}
            print(f"{rows:2d} rows {k:8}: C step {statistics.median(sum(q.values()) for q in ps):7.2f} ms (best "
                  f"{min(sum(q.values()) for q in ps):.2f}); " + ", ".join(f"{p} {v:.2f}" for p, v in med.items()))
        print(f"{rows:2d} rows: logits bit-equal: {torch.equal(logits['factored'], logits['float32'])}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    eng.shutdown()


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "--cstep":
        cstep(args[1] if len(args) > 1 else DEFAULT, int(os.environ.get("ROUNDS", 10)), 4)   # DEFAULT: Gemma
        return
    if args and args[0] == "--sweep":
        sweep(int(args[1]) if len(args) > 1 else 24)
        return
    if args and args[0] == "--matrices":
        matrices()
        return
    if args and args[0] == "_child":
        print(json.dumps(child(args[1], args[2])))
        return
    rounds = 2
    if "--rounds" in args:
        i = args.index("--rounds")
        rounds = int(args[i + 1])
        del args[i:i + 2]
    path = args[0] if args else DEFAULT
    results: dict[str, list[dict]] = {"compact": [], "plain": []}
    for rnd in range(rounds):
        for form in (("compact", "plain") if rnd % 2 == 0 else ("plain", "compact")):
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, KVFLEET_CACHE_DIR=cache, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1",
                           OMP_WAIT_POLICY="PASSIVE")
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_child", path, form], env=env,
                                      capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"{form} failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[form].append(r)
            print(f"round {rnd} {form:7}: one stream {r['one']['decode_tok_s']:.1f} tok/s (step "
                  f"{r['one']['step_ms']:.2f} ms), 48 at once {r['many']['output_tok_s']:.1f} tok/s (48-row step "
                  f"{r['many']['step48_ms']:.1f} ms)  [load {os.getloadavg()[0]:.1f}]", flush=True)
    from kvfleet.kernels import cpu_features

    print(f"\nCPU: {cpu_features.detect().summary()}; best of {rounds} rounds; {os.path.basename(path)}")
    print("| form | one stream decode tok/s | 1-row step ms | 48 at once output tok/s | 48-row step ms |")
    print("|---|---:|---:|---:|---:|")
    best = {}
    for form, rs in results.items():
        best[form] = (max(r["one"]["decode_tok_s"] for r in rs), min(r["one"]["step_ms"] for r in rs),
                      max(r["many"]["output_tok_s"] for r in rs), min(r["many"]["step48_ms"] for r in rs))
        print(f"| {form} | {best[form][0]:.1f} | {best[form][1]:.2f} | {best[form][2]:.1f} | {best[form][3]:.1f} |")
    c, p = best["compact"], best["plain"]
    same = all(r["one"]["token_ids"] == results["plain"][0]["one"]["token_ids"]
               and r["many"]["token_ids"] == results["plain"][0]["many"]["token_ids"] for r in results["compact"])
    print(f"| compact / plain | {c[0] / p[0]:.2f}x | {c[1] / p[1]:.2f}x | {c[2] / p[2]:.2f}x | {c[3] / p[3]:.2f}x |")
    print(f"same tokens: {same}")


if __name__ == "__main__":
    main()
