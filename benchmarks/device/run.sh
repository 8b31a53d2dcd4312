#!/usr/bin/env bash
# Run benchmarks/gpu_check.py on the GPU machine, from the repo root, in one device call.
# Prepared here by benchmarks/device/prepare.sh (wheels + model in .whl/); the exact `run`
# call is in docs/performance.md, "How to run the GPU check".
#
# 1. installs .whl/*.whl into $SITE (no index, no network) and puts kvfleet on the path
#    (links $SITE/kvfleet/{runtime,kernels,operator} -> the checkout's folders: no build);
# 2. prints nvidia-smi and the python/torch/triton/transformers versions;
# 3. runs each section of gpu_check.py in its own process (a CUDA error that poisons one
#    context cannot take the other sections with it), each under a hard time limit, the
#    correctness grid split over $SHARDS parallel processes (they share Triton's compile
#    time, which dominates that section);
# 4. merges the sections' JSON into $OUT/summary.json and prints the summary.
#
# Everything printed also goes to $OUT/gpu_check.log. Exit status: 0 when correctness and the
# engine comparison passed and no timing section failed; 1 when one did; 3 when the set-up
# (install, imports) failed.
#
# Environment (defaults): OUT (/tmp/gpu_check_out), PYTHON (python3), SITE (/tmp/site),
# RUN_BUDGET_S (480: seconds from the start of this script to the end of the last section),
# SHARDS (8), WORK_DIR (the per-section files; default a temporary folder, removed), WHEELS_DIR (.whl), GPU_CHECK_EXTRA_ARGS (none; --smoke runs it all on CPU under the Triton
# interpreter, which is how this script is tested without a GPU), ENGINE_MODEL (the .gguf in
# .whl/model/, else gpu_check's default model).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/gpu_check_out}
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
RUN_BUDGET_S=${RUN_BUDGET_S:-480}
SHARDS=${SHARDS:-8}
WHEELS=${WHEELS_DIR:-.whl}
read -r -a EXTRA <<< "${GPU_CHECK_EXTRA_ARGS:-}"
W=${WORK_DIR:-$(mktemp -d /tmp/gpu_check.XXXXXX)}   # per-process logs and JSON, merged into $OUT at the end
mkdir -p "$W"
mkdir -p "$OUT"

main() {
export PYTHONSAFEPATH=1    # the checkout's operator/ must not shadow the stdlib operator module
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KVFLEET_CACHE_DIR=${KVFLEET_CACHE_DIR:-/tmp/kvfleet-cache}   # the GGUF -> fp32 conversion

echo "== set-up ($(date -u +%FT%TZ), $REPO)"
if ls "$WHEELS"/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "run.sh: installing $WHEELS/*.whl failed"; return 3; }
  echo "installed into $SITE: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
else
  mkdir -p "$SITE"
  echo "no $WHEELS/*.whl: using the machine's packages only (run benchmarks/device/prepare.sh and carry .whl)"
fi
mkdir -p "$SITE/kvfleet"
for sub in runtime kernels operator; do ln -sfn "$REPO/$sub" "$SITE/kvfleet/$sub"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
MODEL=${ENGINE_MODEL:-$(ls "$WHEELS"/model/*.gguf 2> /dev/null | head -1)}

nvidia-smi || echo "(nvidia-smi not available)"
"$PY" - << 'EOF' || { echo "run.sh: the imports gpu_check needs failed"; return 3; }
import importlib, sys
import torch, triton, transformers, pydantic
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}); triton {triton.__version__}; transformers {transformers.__version__}; "
      f"pydantic {pydantic.VERSION}")
if torch.cuda.is_available():
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"{torch.cuda.device_count()} device(s)")
for name in ("gguf", "kvfleet.runtime.llm", "kvfleet.kernels", "kvfleet.kernels.testing"):
    mod = importlib.import_module(name)
    print(f"import {name}: {getattr(mod, '__version__', '')} {mod.__file__}")
EOF
echo "engine model: ${MODEL:-gpu_check default (SmolLM2-135M-Instruct)}"

# Seconds left before the overall budget, less what later steps need at least.
left() { echo $((RUN_BUDGET_S - SECONDS - $1)); }
cap() { # cap DEFAULT RESERVE_FOR_LATER_STEPS -> min(DEFAULT, left)
  local l; l=$(left "$2"); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"
}
gpu_check() { # gpu_check NAME LIMIT_S ARGS...: one process, hard limit, its own log and JSON
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" "$PY" benchmarks/gpu_check.py --budget-s $((limit - 10)) --json "$W/$name.json" \
    "${EXTRA[@]}" "$@" > "$W/$name.log" 2>&1
  echo $? > "$W/$name.status"
}
section() { # section NAME LIMIT_S ARGS...: run it in the foreground, then show its log
  local name=$1 limit=$2
  if [ "$limit" -lt 40 ]; then
    echo -e "\n==== $name: not run ($limit s left of RUN_BUDGET_S=$RUN_BUDGET_S)"; return
  fi
  echo -e "\n==== $name (limit $limit s, t=$SECONDS s)"
  gpu_check "$@"
  cat "$W/$name.log"
  echo "---- $name: exit $(cat "$W/$name.status"), t=$SECONDS s"
}

lim=$(cap 150 240)
echo -e "\n==== correctness: $SHARDS processes in parallel (limit $lim s, t=$SECONDS s)"
echo "$SHARDS" > "$W/shards"
for k in $(seq 0 $((SHARDS - 1))); do
  gpu_check "correctness.$k" "$lim" --only correctness --shard "$k/$SHARDS" &
done
wait
for k in $(seq 0 $((SHARDS - 1))); do
  echo "---- shard $k/$SHARDS: exit $(cat "$W/correctness.$k.status")"
  sed 's/^/  | /' "$W/correctness.$k.log"
done
echo "---- correctness: t=$SECONDS s"

section engine "$(cap 150 90)" --only engine ${MODEL:+--engine-model "$MODEL"}
section decode "$(cap 100 60)" --only decode
section prefill "$(cap 70 0)" --only prefill

"$PY" benchmarks/device/summarize.py "$W" "$OUT/summary.json"
rc=$?
for s in correctness engine decode prefill; do   # the merged files are in summary.json; keep the raw ones too
  [ -f "$W/$s.json" ] && cp "$W/$s.json" "$OUT/$s.json"
done
[ -n "${WORK_DIR:-}" ] || rm -rf "$W"   # a WORK_DIR given is kept (the tests read its shard files)
echo "run.sh: exit $rc after $SECONDS s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
return $rc
}

main 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
