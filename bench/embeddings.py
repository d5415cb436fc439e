"""Embedding throughput (sequences/s) through the engine, at batch 1 and 64.

Each sequence is a ~--words-word sentence of the local corpus; a batch is
submitted at once (prefill-only requests, one continuous batch). Median of
--repeats runs per batch size.

    .venv/bin/python bench/embeddings.py [--batches 1 64] [--words 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import corpus_text  # noqa: E402

from kiln import LLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--words", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pooling", choices=["last", "mean"], default="last")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory_gib=1.0, enable_prefix_caching=False)
    words = corpus_text().split()
    llm.embed(["warm-up"], pooling=args.pooling)
    print(f"{'batch':>5} {'tokens/seq':>10} {'seq/s':>8}")
    for batch in args.batches:
        texts = [" ".join(words[i * args.words : (i + 1) * args.words]) for i in range(batch)]
        tokens = sum(len(llm.tokenizer.encode(t)) for t in texts) / batch
        rates = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.embed(texts, pooling=args.pooling)
            rates.append(batch / (time.perf_counter() - start))
        print(f"{batch:>5} {tokens:>10.1f} {statistics.median(rates):>8.1f}", flush=True)


if __name__ == "__main__":
    main()
