"""Offline throughput of the default model's loads side by side: kept int4
(the default: the GGUF's Q4_1 projections as Kiln's int4) against
`--quantization float` (the same values dequantized), in one process, the
two engines alternating round by round (a shared box's load hits both).

The bench/workload.py workload (prompts 64-512, outputs 32-256 tokens,
greedy, ignore_eos), prefix caching off.

    PYTHONPATH=. .venv/bin/python bench/quant_offline.py [--threads 1] [--num-requests 32] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from workload import make_workload  # noqa: E402

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.llm.models.default_model import default_model_path  # noqa: E402
from kiln.llm.tokenizer import load_tokenizer  # noqa: E402

LOADS = {"kept int4": None, "float": "float"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {name: LLM(quantization=q, kv_cache_memory_gib=1.0, enable_prefix_caching=False)
               for name, q in LOADS.items()}
    items = make_workload(load_tokenizer(default_model_path()).hf, args.num_requests)
    prompts = [it.prompt_token_ids for it in items]
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True) for it in items]
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], params[:2])
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(reversed(engines)):
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            print(f"round {r} {name}: {rates[name][-1]:.1f} output tok/s ({elapsed:.0f} s)", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    print(f"threads={args.threads} requests={args.num_requests}: "
          + ", ".join(f"{name} {m:.1f}" for name, m in medians.items())
          + f" output tok/s; kept int4 / float {medians['kept int4'] / medians['float']:.2f}x")


if __name__ == "__main__":
    main()
