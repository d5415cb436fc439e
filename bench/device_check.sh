#!/usr/bin/env bash
# Kiln's check on a CUDA machine (no network needed): the GPU tests, then the
# GPU benchmark table (bench/gpu_bench.py). About 6-8 minutes on one H200,
# at most 4 + 5.5 minutes (the two steps' time limits).
#
#   bash bench/device_check.sh               # tests/gpu, then both models
#   bash bench/device_check.sh --quick       # tests/gpu, then Llama-3.2-1B at batch 64 only
#   bash bench/device_check.sh --tests-only  # or --bench-only: one of the two steps
#   bash bench/device_check.sh --dry-run     # what is here and what would run; the table of a fake result
#
# It installs nothing system-wide and reaches no network. Kiln runs from this
# checkout (PYTHONPATH), with the machine's own torch (CUDA) and triton; Python
# packages the machine lacks (msgspec, gguf, ...) come from a wheelhouse
# ($KILN_WHEELHOUSE, default bench/wheelhouse, made by bench/build_wheelhouse.sh
# and carried along) into $KILN_SITE (default /tmp/kiln-site). A CUDA torch or
# triton wheel is far too large to carry: without them here it stops and says so.
# Logs, the table and its JSON go to $OUT when set (the device tool's folder),
# else bench/results/. TP=2 over NCCL runs only where 2 GPUs are visible.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WHEELHOUSE=${KILN_WHEELHOUSE:-$ROOT/bench/wheelhouse}
SITE=${KILN_SITE:-/tmp/kiln-site}
RESULTS=${OUT:-$ROOT/bench/results}
TEST_TIMEOUT_S=${KILN_TEST_TIMEOUT_S:-240}
BENCH_TIMEOUT_S=${KILN_BENCH_TIMEOUT_S:-330}
DRY=0
TESTS=1
BENCH=1
BENCH_ARGS=()
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    --quick) BENCH_ARGS=(--models Llama-3.2-1B --batches 64) ;;
    --tests-only) BENCH=0 ;;
    --bench-only) TESTS=0 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "device_check: unknown option $arg (try --help)" >&2; exit 2 ;;
  esac
done
mkdir -p "$RESULTS"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels here, never the interpreter
say() { printf '\n== %s\n' "$*"; }

say "environment"
"$PY" - <<'EOF'
import importlib.metadata as md, importlib.util, platform, sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
    print("torch", torch.__version__, "| CUDA build", torch.version.cuda, "| GPUs visible", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
except Exception as e:
    print("torch: not importable:", e)
for dist in ("triton", "transformers", "vllm", "nvidia-ml-py", "pytest", "pytest-xdist", "pytest-timeout"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi -L

say "python packages"
# module -> distribution, for what Kiln's GPU path and tests import
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"msgspec": "msgspec", "gguf": "gguf", "pydantic": "pydantic", "pydantic_core": "pydantic_core",
        "annotated_types": "annotated_types", "typing_inspection": "typing_inspection", "fastapi": "fastapi",
        "starlette": "starlette", "uvicorn": "uvicorn", "httptools": "httptools"}
print(" ".join(dist for module, dist in need.items() if importlib.util.find_spec(module) is None))
EOF
)
if [ -z "$MISSING" ]; then
  echo "all present"
else
  echo "missing here: $MISSING"
  WHEELS=()
  for dist in $MISSING; do
    found=$(ls "$WHEELHOUSE"/"$dist"-*.whl 2>/dev/null | head -1)
    if [ -n "$found" ]; then WHEELS+=("$found"); else echo "  $dist: no wheel in $WHEELHOUSE (bench/build_wheelhouse.sh makes them)"; fi
  done
  if [ ${#WHEELS[@]} -gt 0 ]; then
    if [ $DRY = 1 ]; then
      echo "would install into $SITE: ${WHEELS[*]##*/}"
    else
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${WHEELS[@]}" \
        && echo "installed into $SITE: ${WHEELS[*]##*/}"
    fi
  fi
fi

READY=$("$PY" -c "
import importlib.util, torch
print('yes' if torch.cuda.is_available() and importlib.util.find_spec('triton') else 'no')" 2>/dev/null || echo no)
if [ $DRY = 1 ]; then
  say "dry run (CUDA + triton usable here: $READY)"
  echo "would run: $PY -m pytest tests/gpu -q  (xdist -n 4 if installed; timeout ${TEST_TIMEOUT_S}s)"
  echo "would run: $PY bench/gpu_bench.py ${BENCH_ARGS[*]} --json $RESULTS/gpu_bench.json  (timeout ${BENCH_TIMEOUT_S}s)"
  "$PY" -m pytest tests/gpu -q --collect-only -p no:cacheprovider 2>&1 | tail -1
  echo "the table, from made-up figures:"
  "$PY" bench/gpu_bench.py --fake
  exit 0
fi
if [ "$READY" != yes ]; then
  echo "device_check: needs torch with a visible CUDA GPU and triton; this machine has not (see above)" >&2
  exit 1
fi

TESTS_RC=0
if [ $TESTS = 1 ]; then
  say "GPU tests (tests/gpu)"
  XDIST=()
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
  timeout "$TEST_TIMEOUT_S" "$PY" -m pytest tests/gpu -q -p no:cacheprovider -rs "${XDIST[@]}" 2>&1 \
    | tee "$RESULTS/gpu_tests.log"
  TESTS_RC=${PIPESTATUS[0]}
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  if [ "$GPUS" -lt 2 ]; then
    echo "TP=2 over NCCL: not run, this machine has $GPUS GPU (test_tensor_parallel_2_over_nccl_matches_one_gpu skipped)"
  fi
fi

BENCH_RC=0
if [ $BENCH = 1 ]; then
  say "benchmark (bench/gpu_bench.py ${BENCH_ARGS[*]})"
  timeout "$BENCH_TIMEOUT_S" "$PY" bench/gpu_bench.py "${BENCH_ARGS[@]}" --json "$RESULTS/gpu_bench.json" \
    2>&1 | tee "$RESULTS/gpu_bench.md"
  BENCH_RC=${PIPESTATUS[0]}
fi

say "done: tests exit $TESTS_RC, benchmark exit $BENCH_RC; files in $RESULTS"
[ "$TESTS_RC" = 0 ] && [ "$BENCH_RC" = 0 ]
