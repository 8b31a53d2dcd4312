"""One-command check of kvfleet's GPU path: kernel correctness, kernel speed, engine output.

Run on any machine with one CUDA GPU (target: under 5 minutes)::

    python benchmarks/gpu_check.py                 # everything (--quick: smaller timing grid)
    python benchmarks/gpu_check.py --skip-engine   # kernels only
    python benchmarks/gpu_check.py --smoke         # no GPU: kernel sections on CPU, Triton interpreter, tiny shapes
    python benchmarks/gpu_check.py --json out.json --only correctness --shard 0/8

Sections (each in its own try/except, skipped once ``--budget-s`` is used up): correctness
(Triton vs the torch reference on the GPU over the test grid), decode timing (bandwidth as a
fraction of peak), prefill timing (TFLOP/s), engine (``LLM`` on CUDA vs CPU, identical greedy
token ids), compiled (``enforce_eager=False``: the compiled decoder with CUDA graphs for decode
batches vs the eager engine on the same device: identical greedy tokens, warm-up seconds, graph
replays, decode tok/s of both; ``--smoke``: on CPU with ``KVFLEET_COMPILE_BACKEND=eager``, dynamo
and the custom op without inductor or CUDA graphs), lora (the Triton batched-LoRA kernels vs the torch
oracle and their time vs the stacked torch path; in ``--smoke`` only with ``--only lora``).
``--json`` writes per-section status, seconds, error and rows.
Exit status: 0 when every section that ran passed, 1 when any failed, 2 without a CUDA device.
Grid, shapes and formulas: docs/performance.md, "How to run the GPU check".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The shared helpers and the engine sections live beside the device scripts.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "device"))
from engine_sections import section_compiled, section_engine, section_spec_decode
from gpu_common import (
    GPU_PEAKS,
    Budget,
    Sizes,
    cuda_time,
    log,
    lookup_peaks,
    measured_copy_bandwidth,
    sync,
)

__all__ = ["GPU_PEAKS", "Budget", "Sizes", "cuda_time", "log", "lookup_peaks", "measured_copy_bandwidth",
           "section_compiled", "section_engine", "section_spec_decode", "sync"]

# --------------------------------------------------------------------------- sections


def section_correctness(torch, device, budget: Budget, sz: Sizes, rec: dict, shard: tuple[int, int] = (0, 1)) -> bool:
    """Triton kernels vs the torch reference. ``shard=(k, n)`` runs cases ``i % n == k``: the
    grid's batches, then the shuffled-blocks, sliding-window/soft-cap and reshape_and_cache
    cases, numbered on from the grid's, so that every shard gets its share of them."""
    from kvfleet.kernels import paged_attention_torch, reshape_and_cache_torch
    from kvfleet.kernels.testing import TOLERANCES, make_paged_batch
    from kvfleet.kernels.triton_attention import paged_attention_triton
    from kvfleet.kernels.triton_cache import reshape_and_cache_triton

    def seq_mix(bs):
        return [(1, 1), (bs, 1), (bs + 1, 1), (2 * bs + 5, 1), (bs + 1, bs + 1), (2 * bs + 3, bs - 1), (bs, bs),
                *sz.long_seqs]

    failures, checks = [], 0

    def check(label, out, ref, dtype):
        nonlocal checks
        checks += 1
        atol, rtol = TOLERANCES[dtype]
        ok = bool(torch.isfinite(out).all()) and torch.allclose(out.float(), ref.float(), atol=atol, rtol=rtol)
        if not ok:
            err = (out.float() - ref.float()).abs().max().item()
            failures.append(f"{label}: max abs err {err:.3e} (atol {atol}, rtol {rtol})")

    dtypes = [torch.float32, torch.float16] if sz.smoke else [torch.float32, torch.float16, torch.bfloat16]
    shard_k, shard_n = shard
    rec.update(shard=f"{shard_k}/{shard_n}", cut_short=False)
    case = -1

    def mine() -> bool:  # the next case: this shard's?
        nonlocal case
        case += 1
        return case % shard_n == shard_k

    for bs in sz.grid_block_sizes:
        for head_size in sz.grid_head_sizes:
            for h, kvh in sz.grid_heads:
                for dtype in dtypes:
                    if not mine():
                        continue
                    if budget.left() < (5 if sz.smoke else 60):
                        if not rec["cut_short"]:
                            failures.append("correctness grid cut short by the time budget")
                        rec["cut_short"] = True
                        break
                    b = make_paged_batch(seq_mix(bs), num_heads=h, num_kv_heads=kvh, head_size=head_size,
                                         block_size=bs, dtype=dtype, device=device, seed=bs + head_size + h)
                    ref = paged_attention_torch(*b.attn_args)
                    for splits in sz.split_options:
                        out = paged_attention_triton(*b.attn_args, num_splits=splits, max_seq_len=b.max_seq_len)
                        check(f"attn bs={bs} d={head_size} h={h}/{kvh} {dtype} splits={splits}", out, ref, dtype)
    # shuffled blocks: identical output
    if mine():
        shuffle_dtype = torch.float16 if sz.smoke else torch.bfloat16
        a = make_paged_batch(seq_mix(16), num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                             dtype=shuffle_dtype, device=device, shuffle=False, seed=5)
        b = make_paged_batch(seq_mix(16), num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                             dtype=shuffle_dtype, device=device, shuffle=True, seed=5)
        checks += 1
        if not torch.equal(paged_attention_triton(*a.attn_args), paged_attention_triton(*b.attn_args)):
            failures.append("shuffled physical blocks changed the output")
    # sliding window (Mistral/Gemma-style local layers) and logit soft-capping (Gemma 2)
    for window, softcap in ((7, None), (100, None), (None, 30.0), (33, 50.0)):
        for dtype in dtypes:
            if not mine():
                continue
            b = make_paged_batch(seq_mix(16), num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                                 dtype=dtype, device=device, seed=11)
            ref = paged_attention_torch(*b.attn_args, sliding_window=window, softcap=softcap)
            for splits in sz.split_options:
                out = paged_attention_triton(*b.attn_args, num_splits=splits, max_seq_len=b.max_seq_len,
                                             sliding_window=window, softcap=softcap)
                check(f"attn window={window} softcap={softcap} {dtype} splits={splits}", out, ref, dtype)
    # reshape_and_cache, slot -1 untouched
    for dtype in dtypes:
        for bs, kvh, d in sz.cache_shapes:
            if not mine():
                continue
            b = make_paged_batch([(bs + 1, bs + 1), (40, 7), (3, 1)], num_heads=kvh, num_kv_heads=kvh, head_size=d,
                                 block_size=bs, dtype=dtype, device=device)
            slots = b.slot_mapping.clone()
            slots[::3] = -1
            kc, vc = b.key_cache.clone(), b.value_cache.clone()
            kr, vr = b.key_cache.clone(), b.value_cache.clone()
            reshape_and_cache_triton(b.new_keys + 1, b.new_values - 1, kc, vc, slots)
            reshape_and_cache_torch(b.new_keys + 1, b.new_values - 1, kr, vr, slots)
            checks += 1
            if not (torch.equal(kc, kr) and torch.equal(vc, vr)):
                failures.append(f"reshape_and_cache bs={bs} kvh={kvh} d={d} {dtype} differs from the reference")
    return _report_correctness(torch, device, rec, checks, failures)


def _report_correctness(torch, device, rec: dict, checks: int, failures: list[str]) -> bool:
    sync(torch, device)
    for f in failures:
        log(f"  FAIL {f}")
    log(f"  {checks - len(failures)}/{checks} correctness checks passed")
    rec.update(checks=checks, passed=checks - len(failures), failures=failures)
    return not failures


def section_decode(torch, device, budget: Budget, sz: Sizes, peak_bw: float, rec: dict) -> bool:
    from kvfleet.kernels.triton_attention import launch_config, paged_attention_triton

    shp = sz.decode_shape
    heads, kv_heads, head_size, block_size = shp["heads"], shp["kv_heads"], shp["head_size"], shp["block_size"]
    dtype = torch.float16 if sz.smoke else torch.bfloat16
    elem = 2
    batches, contexts = sz.decode_batches, sz.decode_contexts
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 2**30
    per_token = kv_heads * head_size * elem  # bytes per token per K (or V)
    limit_tokens = int(0.6 * free / (2 * per_token))
    need = max(B * c for B in batches for c in contexts)
    num_tokens = min(need, limit_tokens)
    num_blocks = num_tokens // block_size
    log(f"  shape: {heads} heads / {kv_heads} kv heads, head_size {head_size}, {str(dtype)[6:]}, "
        f"block_size {block_size}; cache {num_blocks} blocks "
        f"({2 * num_blocks * block_size * per_token / 2**30:.2f} GiB)")
    key_cache = torch.empty(num_blocks, block_size, kv_heads, head_size, dtype=dtype, device=device).normal_()
    value_cache = torch.empty_like(key_cache).normal_()
    log(f"  {'batch':>5s} {'context':>7s} {'splits':>6s} {'us/call':>9s} {'GB/s':>8s} {'of peak':>8s}")
    rows = rec.setdefault("rows", [])
    rec.update(shape=dict(shp, dtype=str(dtype)[6:]), peak_bandwidth_bytes_per_s=peak_bw)
    ok = True
    for B in batches:
        for ctx in contexts:
            if budget.left() < (5 if sz.smoke else 30):
                log("  (time budget: remaining decode cases skipped)")
                rec["cut_short"] = True
                return ok
            if B * ctx > num_tokens:
                log(f"  {B:5d} {ctx:7d}  skipped: needs {2 * B * ctx * per_token / 2**30:.1f} GiB of cache")
                rows.append(dict(batch=B, context=ctx, skipped="cache does not fit in 60% of free memory"))
                continue
            try:
                nb = ctx // block_size
                perm = torch.randperm(num_blocks, device=device)[: B * nb]
                bt = perm.view(B, nb).to(torch.int32)
                sl = torch.full((B,), ctx, dtype=torch.int32, device=device)
                qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
                q = torch.randn(B, heads, head_size, dtype=dtype, device=device)
                out = torch.empty_like(q)
                splits = launch_config(B, B, heads, kv_heads, head_size, max_query_len=1, max_seq_len=ctx,
                                       device=q.device).num_splits
                t = cuda_time(torch, lambda q=q, kc=key_cache, vc=value_cache, bt=bt, sl=sl, qsl=qsl, ctx=ctx, out=out:
                              paged_attention_triton(q, kc, vc, bt, sl, qsl, None, max_query_len=1, max_seq_len=ctx,
                                                     out=out),
                    iters=sz.iters or (20 if B * ctx < 2**22 else 8))
                bytes_moved = 2 * B * ctx * per_token + 2 * q.numel() * elem + bt.numel() * 4
                bw = bytes_moved / t
                log(f"  {B:5d} {ctx:7d} {splits:6d} {t * 1e6:9.1f} {bw / 1e9:8.1f} {bw / peak_bw:8.1%}")
                rows.append(dict(batch=B, context=ctx, num_splits=splits, us_per_call=t * 1e6,
                                 bytes_per_call=bytes_moved, gb_per_s=bw / 1e9, fraction_of_peak=bw / peak_bw))
            except Exception as e:
                ok = False
                log(f"  {B:5d} {ctx:7d}  FAILED: {type(e).__name__}: {e}")
                rows.append(dict(batch=B, context=ctx, error=f"{type(e).__name__}: {e}"))
    del key_cache, value_cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def section_prefill(torch, device, budget: Budget, sz: Sizes, peak_flops: float | None, rec: dict) -> bool:
    from kvfleet.kernels.testing import make_paged_batch
    from kvfleet.kernels.triton_attention import paged_attention_triton

    cases = sz.prefill_cases
    heads, kv_heads, head_size = sz.prefill_shape["heads"], sz.prefill_shape["kv_heads"], sz.prefill_shape["head_size"]
    dtype = torch.float16 if sz.smoke else torch.bfloat16
    log(f"  shape: {heads} heads / {kv_heads} kv heads, head_size {head_size}, {str(dtype)[6:]}, block_size 16")
    rows = rec.setdefault("rows", [])
    rec.update(shape=dict(sz.prefill_shape, dtype=str(dtype)[6:], block_size=16), peak_flops=peak_flops)
    ok = True
    for name, seqs in cases:
        if budget.left() < (5 if sz.smoke else 30):
            log("  (time budget: remaining prefill cases skipped)")
            rec["cut_short"] = True
            break
        try:
            b = make_paged_batch(seqs, num_heads=heads, num_kv_heads=kv_heads, head_size=head_size, block_size=16,
                                 dtype=dtype, device=device, garbage=1.0)
            out = torch.empty_like(b.query)
            mq = max(q for _, q in seqs)
            t = cuda_time(torch, lambda b=b, mq=mq, out=out: paged_attention_triton(
                *b.attn_args, max_query_len=mq, max_seq_len=b.max_seq_len, out=out), iters=sz.iters or 10)
            pairs = sum(sum(L - q + i + 1 for i in range(q)) for L, q in seqs)  # visible (query, key) pairs
            flops = 4 * head_size * heads * pairs
            frac = f"{flops / t / peak_flops:8.1%}" if peak_flops else "     n/a"
            log(f"  {name:55s} {t * 1e3:8.3f} ms {flops / t / 1e12:7.1f} TFLOP/s {frac} of bf16 peak")
            rows.append(dict(case=name, ms_per_call=t * 1e3, flops_per_call=flops, tflop_per_s=flops / t / 1e12,
                             fraction_of_peak=flops / t / peak_flops if peak_flops else None))
        except Exception as e:
            ok = False
            log(f"  {name}: FAILED: {type(e).__name__}: {e}")
            rows.append(dict(case=name, error=f"{type(e).__name__}: {e}"))
    return ok

# --------------------------------------------------------------------------- main


def section_lora(torch, device, budget: Budget, sz: Sizes, rec: dict) -> bool:
    """Batched LoRA (issue 17): the Triton BGMV kernels vs the per-token torch oracle on the device,
    mixed slots (-1 = base) over 4 slots of rank 16, fp16 and bf16; then their time vs the stacked
    torch path (:func:`kvfleet.kernels.lora.lora_stacked_torch`) at decode and prefill sizes."""
    from kvfleet.kernels.lora import lora_bgmv_torch, lora_stacked_torch, slot_mask
    from kvfleet.kernels.triton_lora import lora_bgmv_triton

    shapes = [(5, 40, 24)] if sz.smoke else [(1, 4096, 4096), (64, 4096, 1024), (512, 4096, 14336)]
    dtypes = (torch.float16,) if sz.smoke else (torch.float16, torch.bfloat16)
    slots_n, rank = 4, (4 if sz.smoke else 16)
    ok, rows = True, []
    for dtype in dtypes:
        for t, d_in, d_out in shapes:
            if budget.left() < 5:
                break
            g = torch.Generator(device="cpu").manual_seed(t)
            x = torch.randn(t, d_in, generator=g).to(device, dtype)
            y = torch.randn(t, d_out, generator=g).to(device, dtype)
            a = (torch.randn(slots_n, rank, d_in, generator=g) / d_in**0.5).to(device, dtype)
            b = (torch.randn(slots_n, rank, d_out, generator=g) * 0.1).to(device, dtype)
            slots = torch.tensor([(i * 7) % (slots_n + 1) - 1 for i in range(t)], device=device)
            ref = lora_bgmv_torch(x, y.clone(), a, b, slots).float()
            got = lora_bgmv_triton(x, y.clone(), a, b, slots).float()
            err = float((got - ref).abs().max())
            good = err <= 2e-2 * max(1.0, float(ref.abs().max()))
            ok &= good
            mask = slot_mask(slots, slots_n, rank, dtype)
            iters = sz.iters or 20
            args = (x, y, a, b, slots, mask)
            t_tri = cuda_time(torch, lambda p=args: lora_bgmv_triton(p[0], p[1].clone(), p[2], p[3], p[4]),
                              iters=iters, warmup=1)
            t_stk = cuda_time(torch, lambda p=args: lora_stacked_torch(p[0], p[1].clone(), p[2], p[3], p[5]),
                              iters=iters, warmup=1)
            row = dict(dtype=str(dtype).removeprefix("torch."), tokens=t, d_in=d_in, d_out=d_out, max_abs_err=err,
                       ok=good, triton_us=t_tri * 1e6, stacked_torch_us=t_stk * 1e6)
            rows.append(row)
            log(f"  lora {row['dtype']} T={t} {d_in}->{d_out}: err {err:.2e} {'ok' if good else 'MISMATCH'}; "
                f"triton {t_tri * 1e6:.1f} us, stacked torch {t_stk * 1e6:.1f} us")
    rec["rows"] = rows
    return ok and bool(rows)


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected K/N, e.g. 0/8") from None
    if not (n >= 1 and 0 <= k < n):
        raise argparse.ArgumentTypeError(f"--shard {text!r}: need N >= 1 and 0 <= K < N")
    return k, n


def write_json(path: str | None, report: dict) -> None:
    """Write ``report`` to ``path`` (no-op for None); NaN/inf become null."""
    if not path:
        return

    def clean(x):
        if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(clean(report), f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=280.0, help="overall time budget, seconds (default 280)")
    ap.add_argument("--quick", action="store_true", help="smaller timing grids")
    ap.add_argument("--skip-engine", action="store_true", help="kernels only")
    ap.add_argument("--only", choices=["correctness", "decode", "prefill", "engine", "compiled", "lora", "spec_decode"],
                    action="append",
                    help="run only these sections (repeatable)")
    ap.add_argument("--engine-max-tokens", type=int, default=32)
    ap.add_argument("--engine-model", default=None,
                    help="checkpoint directory or .gguf file for the engine section (default: the embedded "
                         "SmolLM2-135M-Instruct)")
    ap.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                    help="correctness: run grid cases i with i %% N == K (default 0/1: all)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as one JSON object to PATH")
    ap.add_argument("--smoke", action="store_true",
                    help="exercise the kernel sections on CPU under the Triton interpreter with tiny shapes "
                         "(checks this script itself, not the GPU; the engine section runs only with "
                         "--only engine, comparing the interpreted Triton backend with torch on CPU)")
    args = ap.parse_args(argv)
    budget = Budget(args.budget_s)
    if args.smoke:
        # Must precede the first triton import (the kernels are imported lazily below).
        os.environ["TRITON_INTERPRET"] = "1"

    import torch

    report: dict = dict(argv=sys.argv[1:] if argv is None else list(argv), smoke=args.smoke, quick=args.quick,
                        versions=dict(python=sys.version.split()[0], torch=torch.__version__), gpu=None,
                        sections={})
    log(f"kvfleet gpu_check: torch {torch.__version__}, python {sys.version.split()[0]}")
    if args.smoke:
        import triton

        device = torch.device("cpu")
        name = "CPU (smoke test under TRITON_INTERPRET=1: timings are meaningless)"
        peak_bw, peak_flops = 1e11, None
        report["versions"]["triton"] = triton.__version__
        log(f"GPU: none; {name}, triton {triton.__version__}")
    elif not torch.cuda.is_available():
        log("No CUDA device available (torch.cuda.is_available() is False): nothing checked. "
            "Run this on a machine with an NVIDIA GPU and a CUDA build of torch.")
        report.update(exit_code=2, error="no CUDA device (torch.cuda.is_available() is False)")
        write_json(args.json, report)
        return 2
    else:
        import triton

        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        log(f"GPU: {name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"{props.total_memory / 2**30:.0f} GiB), triton {triton.__version__}, CUDA {torch.version.cuda}")
        report["versions"].update(triton=triton.__version__, cuda=torch.version.cuda)
        report["gpu"] = dict(name=name, capability=f"sm_{props.major}{props.minor}",
                             multiprocessors=props.multi_processor_count, memory_gib=props.total_memory / 2**30)
        peak_bw, peak_flops = lookup_peaks(name)
        if peak_bw is None:
            try:
                peak_bw = measured_copy_bandwidth(torch, device)
                log(f"peak bandwidth: not in the table; measured copy bandwidth {peak_bw / 1e12:.2f} TB/s used")
                report["gpu"]["peak_bandwidth_source"] = "measured device-to-device copy"
            except Exception as e:
                peak_bw = float("nan")
                log(f"peak bandwidth unknown ({e})")
        else:
            log(f"peak bandwidth {peak_bw / 1e12:.2f} TB/s, bf16 dense peak "
                f"{'%.0f TFLOP/s' % (peak_flops / 1e12) if peak_flops else 'unknown'} (datasheet)")
            report["gpu"]["peak_bandwidth_source"] = "datasheet table"
        report["gpu"].update(peak_bandwidth_bytes_per_s=peak_bw, peak_bf16_flops=peak_flops)
    sz = Sizes(args.smoke, args.quick)
    report["device"] = name

    recs = {sec: {} for sec in ("correctness", "decode", "prefill", "engine", "compiled", "lora", "spec_decode")}
    sections = [
        ("correctness", lambda: section_correctness(torch, device, budget, sz, recs["correctness"], args.shard),
         5 if args.smoke else 60),
        ("decode", lambda: section_decode(torch, device, budget, sz, peak_bw, recs["decode"]), 5 if args.smoke else 30),
        ("prefill", lambda: section_prefill(torch, device, budget, sz, peak_flops, recs["prefill"]),
         5 if args.smoke else 20),
        ("engine", lambda: section_engine(torch, budget, args.engine_max_tokens, recs["engine"], args.engine_model,
                                          smoke=args.smoke), 5 if args.smoke else 60),
        ("compiled", lambda: section_compiled(torch, budget, args.engine_max_tokens, recs["compiled"],
                                              args.engine_model, smoke=args.smoke), 5 if args.smoke else 90),
        ("lora", lambda: section_lora(torch, device, budget, sz, recs["lora"]), 5 if args.smoke else 15),
        ("spec_decode", lambda: section_spec_decode(torch, budget, args.engine_max_tokens, recs["spec_decode"],
                                                    args.engine_model, smoke=args.smoke), 5 if args.smoke else 40),
    ]
    results = {}
    for sec, fn, min_left in sections:
        if args.only and sec not in args.only:
            continue
        smoke_skip = args.smoke and not (args.only and sec in args.only)
        engine_sec = sec in ("engine", "compiled", "spec_decode")
        if engine_sec and (args.skip_engine or smoke_skip) or sec == "lora" and smoke_skip:
            continue
        rec = recs[sec]
        report["sections"][sec] = rec
        if budget.left() < min_left:
            log(f"\n== {sec}: SKIPPED ({budget.left():.0f} s of budget left, needs ~{min_left} s)")
            results[sec] = None
            rec.update(status="skipped", reason=f"{budget.left():.0f} s of budget left, needs ~{min_left} s")
            write_json(args.json, report)
            continue
        log(f"\n== {sec} (t={budget.elapsed():.0f} s)")
        t0 = time.monotonic()
        try:
            results[sec] = bool(fn())
        except Exception as e:
            results[sec] = False
            rec["error"] = f"{type(e).__name__}: {e}"
            log(f"  FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=6)
            sys.stderr.flush()
        rec.update(status="pass" if results[sec] else "fail", seconds=time.monotonic() - t0)
        log(f"  -> {'PASS' if results[sec] else 'FAIL'} in {time.monotonic() - t0:.1f} s")
        write_json(args.json, report)  # after every section: a later crash or kill keeps what ran
    log(f"\nSummary on {name} ({budget.elapsed():.0f} s): "
        + ", ".join(f"{k}={'skipped' if v is None else ('PASS' if v else 'FAIL')}" for k, v in results.items()))
    code = 0 if all(v is not False for v in results.values()) else 1
    report.update(exit_code=code, seconds=budget.elapsed())
    write_json(args.json, report)
    return code


if __name__ == "__main__":
    sys.exit(main())
