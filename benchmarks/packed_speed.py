"""One stream's decode speed of the 4-bit checkpoints users download, served with no flags, against
the same model served from float32 weights with ``--quantization int4``. Not a test::

    python benchmarks/packed_speed.py [--tokens 96] [--group 64] [--formats awq,gptq,gptq-act,ct] [--rounds 1]

The default model (SmolLM2-135M-Instruct, its float32 weights) is quantized by the packed-checkpoint
tests' reference quantizer (tests/support/packed_writer.py) into each format's own layout: AWQ GEMM
(asymmetric), GPTQ v1 (symmetric, without and with act-order), compressed-tensors pack-quantized
(symmetric), groups of ``--group`` (64: the model's 576-wide rows are no multiple of 128). Each
checkpoint is loaded with no flags, and its dequantized float32 model (what the checkpoint holds)
with ``--quantization int4``; each run in a fresh process, one after the other, one prompt at a
time (engine level, ``LLM.generate``: the server adds the same HTTP cost to both): decode tok/s =
``(tokens - 1) / (t(tokens) - t(1))``, best of 3, and whether the fused decoder ran it; with
``--rounds N`` the two processes alternate N times and each side keeps its best (a shared machine's
load drifts between runs). ``KVFLEET_CPU_MATMUL=float32`` runs both sides on the float32 kernels
(where the CPU plan gives ``--quantization int4`` bf16 matmuls and the packed checkpoint float32
ones, the default compares different kernels). The first line records the CPU, the load average and
that setting. Results:
docs/performance.md, "Packed 4-bit checkpoints: one stream".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
from kvfleet.runtime.llm import LLM
from kvfleet.runtime.sampling_params import SamplingParams
folder, quant, tokens = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
llm = LLM(model=folder, quantization=quant, max_model_len=512)
prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
def run(n):
    t0 = time.monotonic()
    out = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == n
    return time.monotonic() - t0
run(8)
best = min((tokens - 1) / (run(tokens) - run(1)) for _ in range(3))
loaded = llm.llm_engine.loaded
print(json.dumps({"tok_s": best, "fused": llm.llm_engine.runner.cpu_decode is not None,
                  "weights": loaded.cpu_plan.weights, "weight_mb": loaded.weight_bytes / 2**20}))
"""

FORMATS = {"awq": ("awq", False, False), "gptq": ("gptq", True, False), "gptq-act": ("gptq", True, True),
           "ct": ("ct", True, False)}


def _run(folder: Path, quant: str, tokens: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), quant, str(tokens)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{folder.name} {quant or 'no flags'}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two runs this many times, best of each")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support import packed_writer
    from transformers import AutoModelForCausalLM

    from kvfleet.kernels import cpu_features
    from kvfleet.runtime.worker import model_loader

    source, _ = model_loader.resolve_model_path(None)  # the default model's float32 checkpoint
    print(f"CPU: {cpu_features.detect().summary()}; load average {os.getloadavg()}; "
          f"$KVFLEET_CPU_MATMUL={os.environ.get('KVFLEET_CPU_MATMUL', '')!r}")
    print(f"model: the default model's float32 weights ({source}), groups of {args.group}, "
          f"{args.tokens} tokens, one stream")
    print("| checkpoint | served | path | weights MB | decode tok/s | vs float32 + --quantization int4 |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as work:
        for label in args.formats.split(","):
            fmt, sym, act_order = FORMATS[label]
            packed, plain = Path(work) / label, Path(work) / f"{label}-float32"
            packed.mkdir()
            ref = AutoModelForCausalLM.from_pretrained(source, dtype="float32").eval()
            ref = packed_writer.write(packed, ref, fmt, args.group, sym, act_order)
            ref.save_pretrained(plain)  # the float32 model the checkpoint holds
            del ref
            for f in Path(source).iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
                    shutil.copy(f, packed / f.name)
                    shutil.copy(f, plain / f.name)
            base, got = {"tok_s": 0.0}, {"tok_s": 0.0}
            for _ in range(args.rounds):
                base = max(base, _run(plain, "int4", args.tokens), key=lambda r: r["tok_s"])
                got = max(got, _run(packed, "", args.tokens), key=lambda r: r["tok_s"])
            for name, how, r in ((f"{label} (float32)", "--quantization int4", base), (label, "no flags", got)):
                ratio = r["tok_s"] / base["tok_s"]
                print(f"| {name} | {how} | {'fused' if r['fused'] else 'torch (not fused)'}, {r['weights']} | "
                      f"{r['weight_mb']:.0f} | {r['tok_s']:.1f} | {ratio:.2f}x |", flush=True)
            shutil.rmtree(packed)
            shutil.rmtree(plain)
    print(f"load average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
