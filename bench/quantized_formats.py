"""Perplexity of SmolLM2's float weights re-stored in each pre-quantized
format and loaded by Kiln's readers, against the float load of the same
weights (issue 16: "perplexity of each quantized load ... against the same
model's float weights").

The float weights are the installed SmolLM2 GGUF dequantized (its projections
are Q4_1 values: that is the float model Kiln has; nothing is downloaded).
Written at bench time into a temp dir, never committed:

    Q8_0, Q4_0, Q4_1   every projection, the gguf package's quantizers
    Q4_K, Q6_K         down_proj only (rows of 1536; the other projections read
                       rows of 576, not a multiple of the K-quants' 256), the
                       rest float: the K-quant's own effect. Encoders: this
                       suite's round-to-nearest ones (tests/.../writers.py;
                       gguf cannot quantize K-quants, llama.cpp's search-based
                       quantizer would do no worse)
    Q4_K_M-like        down_proj Q4_K, the others Q5_0 (llama.cpp's fallback
                       for rows that are not a multiple of 256)
    FP8                e4m3 weights with per-channel scales (amax / 448), as
                       compressed-tensors stores them, read by Kiln's FP8 reader

Each load runs as Kiln serves it by default (quantization unset: Q4_0/Q4_1/
Q4_K kept as int4, the rest dequantized at load), float32 compute, on the
slice of tests/integration/quant/test_perplexity.py (pydoc topics text from
token --start, --windows windows of --window tokens).

    PYTHONPATH=. .venv/bin/python bench/quantized_formats.py [--windows 2] [--formats Q8_0,FP8]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import corpus_text  # noqa: E402

from kiln.config import EngineConfig  # noqa: E402
from kiln.llm.engine.builder import build_model  # noqa: E402
from kiln.llm.eval.perplexity import perplexity  # noqa: E402
from kiln.llm.models.checkpoint import Checkpoint  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.models.loader import load_checkpoint  # noqa: E402
from kiln.llm.tokenizer import load_tokenizer  # noqa: E402
from tests.integration.quant.test_perplexity import fp8_checkpoint, gguf_checkpoint  # noqa: E402
from tests.unit.llm.quant.formats.writers import PROJECTIONS  # noqa: E402

DOWN = "mlp.down_proj.weight"
ALL = tuple(f"{p}.weight" for p in PROJECTIONS)
GGUF_MIXES = {
    "Q8_0": {s: T.Q8_0 for s in ALL},
    "Q4_0": {s: T.Q4_0 for s in ALL},
    "Q4_1": {s: T.Q4_1 for s in ALL},
    "Q4_K": {DOWN: T.Q4_K},
    "Q6_K": {DOWN: T.Q6_K},
    "Q4_K_M-like": {**{s: T.Q5_0 for s in ALL}, DOWN: T.Q4_K},
}
FORMATS = (*GGUF_MIXES, "FP8")


def model_perplexity(ckpt: Checkpoint, ids: list[int], window: int, **options) -> float:
    config = EngineConfig.from_flat(model=ckpt.source, **{"dtype": "float32", **options})
    model = build_model(ckpt, config, max_model_len=window)
    return perplexity(model, ids, window=window).value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--start", type=int, default=20_000)
    ap.add_argument("--formats", default=",".join(FORMATS))
    args = ap.parse_args()
    path = default_model_path()
    ids = load_tokenizer(path).encode(corpus_text(), add_special_tokens=False)
    ids = ids[args.start : args.start + args.window * args.windows]
    float_ckpt = load_checkpoint(path)
    start = time.perf_counter()
    base = model_perplexity(float_ckpt, ids, args.window, quantization="float")
    print(f"float32: {base:.4f} ({len(ids)} tokens, {time.perf_counter() - start:.0f} s)", flush=True)
    results = {"float32": base}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats.split(","):
            start = time.perf_counter()
            ckpt = (fp8_checkpoint(float_ckpt) if fmt == "FP8"
                    else gguf_checkpoint(Path(tmp) / f"{fmt}.gguf", float_ckpt, GGUF_MIXES[fmt]))
            kept = len(ckpt.quantized)
            results[fmt] = model_perplexity(ckpt, ids, args.window)
            print(f"{fmt}: {results[fmt]:.4f} ({results[fmt] / base:.4f}x float32; {kept} projections kept int4; "
                  f"{time.perf_counter() - start:.0f} s)", flush=True)
            (Path(tmp) / f"{fmt}.gguf").unlink(missing_ok=True)
    print(json.dumps({"window": args.window, "windows": args.windows, "start": args.start, "perplexity": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
