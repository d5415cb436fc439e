#!/usr/bin/env bash
# Wheels of the Kiln dependencies that the CUDA machine's image lacks, for its
# Python (CPython 3.12, manylinux x86-64), into bench/wheelhouse/ (git-ignored).
# The image has torch (CUDA), triton, transformers, numpy, safetensors,
# tokenizers, prometheus_client, nvidia-ml-py, pytest; it lacks msgspec and
# gguf (the engine imports them) and the server's pydantic/fastapi/uvicorn.
# A CUDA torch or triton wheel (hundreds of MB) cannot travel: the machine
# must have its own. Versions follow this checkout's .venv.
#
#   bash bench/build_wheelhouse.sh          # then carry bench/wheelhouse to the device
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
DEST=${1:-bench/wheelhouse}
PACKAGES="msgspec gguf pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn httptools"
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$DEST"
for name in $PACKAGES; do
  version=$($PIP show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  spec=$name${version:+==$version}
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DEST" "$spec"
done
du -sh "$DEST"
ls "$DEST"
