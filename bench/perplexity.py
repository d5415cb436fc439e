"""Perplexity of SmolLM2 in float32, bfloat16, int8 and int4 on Python's
pydoc topics text (bench/workload.py corpus_text), non-overlapping windows
of --window tokens, each one prefill through Kiln's model
(kiln.llm.eval.perplexity.py). --max-windows limits the run to the first N
windows (the full text is ~1.1M characters; say how many windows when quoting).

    PYTHONPATH=. .venv/bin/python bench/perplexity.py [--window 512] [--max-windows N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import corpus_text  # noqa: E402

from kiln.config import EngineConfig  # noqa: E402
from kiln.llm.engine.builder import build_model  # noqa: E402
from kiln.llm.eval.perplexity import perplexity  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.models.loader import load_checkpoint  # noqa: E402
from kiln.llm.tokenizer import load_tokenizer  # noqa: E402

MODES = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    # The default load's int4 projections in bf16 with and without the packed bf16 copy that prompt
    # steps of 128+ rows take (`--int4-prefill-weights`; "bfloat16" above: `auto`).
    "bfloat16-int4-codes": dict(dtype="bfloat16", int4_prefill_weights="int4"),
    "bfloat16-int4-copy": dict(dtype="bfloat16", int4_prefill_weights="bf16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default="bench/results/perplexity.json")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(args.model or default_model_path())
    checkpoint = load_checkpoint(path)
    ids = load_tokenizer(path).encode(corpus_text(), add_special_tokens=False)
    total_windows = len(ids) // args.window
    results = {}
    for mode in args.modes.split(","):
        config = EngineConfig.from_flat(model=path, **MODES[mode])
        model = build_model(checkpoint, config, max_model_len=args.window)
        start = time.perf_counter()
        p = perplexity(model, ids, window=args.window, max_windows=args.max_windows)
        results[mode] = {"perplexity": p.value, "tokens_scored": p.num_tokens, "seconds": time.perf_counter() - start}
        print(mode, json.dumps(results[mode]), flush=True)
        del model
    if "bfloat16" in results:
        for r in results.values():
            r["ratio_to_bf16"] = r["perplexity"] / results["bfloat16"]["perplexity"]
    summary = {"corpus_tokens": len(ids), "window": args.window, "windows_total": total_windows,
               "windows_used": min(total_windows, args.max_windows or total_windows), "results": results}
    print(json.dumps(summary, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
