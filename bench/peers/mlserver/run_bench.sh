#!/usr/bin/env bash
# Side by side over KServe v2 gRPC: the tabular ONNX model through MLServer
# (adaptive batching: max_batch_size 64, max_batch_time 2 ms) and through
# Kiln (dynamic batching: max_queue_delay 2 ms), same client and levels.
# Needs: python examples/tabular/build_repository.py, and MLServer in its own
# venv: python3 -m venv bench/peers/envs/mlserver && bench/peers/envs/mlserver/bin/pip install mlserver onnxruntime
# Over HTTP (JSON tensors, batching on and off, both servers in one run): bench/http_infer.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
VENV=$(cd "${MLSERVER_VENV:-bench/peers/envs/mlserver}" && pwd)  # absolute: mlserver starts in $WORK
WORK=$(mktemp -d)
mkdir -p "$WORK/breast_cancer"
cp bench/peers/mlserver/runtime.py "$WORK/breast_cancer/"
cat > "$WORK/breast_cancer/model-settings.json" <<JSON
{"name": "breast_cancer", "implementation": "runtime.OnnxRuntime",
 "max_batch_size": 64, "max_batch_time": 0.002,
 "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 30]}],
 "parameters": {"uri": "$(pwd)/examples/tabular/repository/breast_cancer/1/model.onnx"}}
JSON
cat > "$WORK/settings.json" <<JSON
{"host": "127.0.0.1", "http_port": 8091, "grpc_port": 8092, "metrics_port": 8093, "parallel_workers": 0}
JSON
(cd "$WORK" && exec "$VENV/bin/mlserver" start . > "$WORK/mlserver.log" 2>&1) &
MLS=$!
.venv/bin/kiln serve --model-repository examples/tabular/repository \
    --port 8094 --grpc-port 8095 --log-level warning > "$WORK/kiln.log" 2>&1 &
KILN=$!
trap 'kill $MLS $KILN 2>/dev/null || true' EXIT
for port in 8091 8094; do
  for _ in $(seq 1 120); do curl -sf "127.0.0.1:$port/v2/health/ready" >/dev/null && break; sleep 0.5; done
done
echo "== MLServer $("$VENV/bin/mlserver" --version)"
.venv/bin/kiln bench infer --protocol grpc --model breast_cancer --url 127.0.0.1:8092 --concurrency 1,8,32 --duration "${DURATION:-4}"
echo "== Kiln"
.venv/bin/kiln bench infer --protocol grpc --model breast_cancer --url 127.0.0.1:8095 --concurrency 1,8,32 --duration "${DURATION:-4}"
