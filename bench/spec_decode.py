"""Speculative decoding on SmolLM2: speculation off vs n-gram vs draft model.

Workloads (chat template, greedy, exactly --max-tokens output tokens each):
  grounded   "Repeat the following text exactly: <~120 tokens of pydoc_data.topics>"
  open       "Write a short story about <topic>." (nothing to look up)
At batch 1, 4, 16 (all requests submitted at once, one continuous batch).
TPOT = per request (finish - first token) / (tokens - 1), averaged;
throughput = all output tokens / wall time; each cell is the median of
--repeats runs, the methods taking turns. The draft model is the target's
first --draft-layers layers + its LM head (no smaller sibling is installed);
point --draft-model at a real one to measure that instead.

    .venv/bin/python bench/spec_decode.py [--max-tokens 48] [--batches 1 4 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from workload import corpus_text  # noqa: E402

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.config import SpecConfig  # noqa: E402

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a market in the rain", "an old map"]


def grounded_prompts(tokenizer, n: int) -> list[list[int]]:
    words = corpus_text().split()
    prompts = []
    for i in range(n):
        text = " ".join(words[2000 + 150 * i : 2000 + 150 * i + 80])
        msg = [{"role": "user", "content": f"Repeat the following text exactly:\n\n{text}"}]
        prompts.append(tokenizer.apply_chat_template(msg, add_generation_prompt=True))
    return prompts


def open_prompts(tokenizer, n: int) -> list[list[int]]:
    msgs = [f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(n)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True) for m in msgs]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{llm._counter}-{i}", p, params)
    llm._counter += 1
    first, done, tokens = {}, {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
                tokens[out.request_id] = len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    tpot = [(done[r] - first[r]) / max(1, tokens[r] - 1) for r in done]
    stats = engine.last_stats
    return {
        "tpot_ms": 1000 * sum(tpot) / len(tpot),
        "tok_s": sum(tokens.values()) / wall,
        "drafts": stats.spec_num_draft_tokens,
        "accepted": stats.spec_num_accepted_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--k", type=int, default=SpecConfig.num_speculative_tokens)
    ap.add_argument("--ngram-min-n", type=int, default=SpecConfig.ngram_min_n)
    ap.add_argument("--ngram-max-n", type=int, default=SpecConfig.ngram_max_n)
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the server's engine default on 2 cores)")
    ap.add_argument("--methods", nargs="+", default=["off", "ngram", "draft"], choices=["off", "ngram", "draft"])
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, methods alternating; medians reported")
    ap.add_argument(
        "--max-batch-for-speculation",
        type=int,
        default=None,
        help="default: the engine's own switch-off rule (SpecConfig)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = {
        "off": {},
        "ngram": dict(
            spec_method="ngram",
            num_speculative_tokens=args.k,
            ngram_min_n=args.ngram_min_n,
            ngram_max_n=args.ngram_max_n,
        ),
        "draft": dict(
            spec_method="draft",
            num_speculative_tokens=args.k,
            # the target's first layers, or a model of its own
            **({"draft_model": args.draft_model} if args.draft_model else {"draft_num_layers": args.draft_layers}),
        ),
    }
    switch = (
        {} if args.max_batch_for_speculation is None else {"max_batch_for_speculation": args.max_batch_for_speculation}
    )
    # Every method's engine is built first; repeats then alternate between
    # them, so a slow minute on a shared machine hits all methods alike.
    llms = {}
    for name in args.methods:
        options = methods[name]
        llms[name] = LLM(args.model, kv_cache_memory_gib=0.5, **(switch if options else {}), **options)
        run(llms[name], open_prompts(llms[name].tokenizer, 1), 4)  # warm-up
    tokenizer = next(iter(llms.values())).tokenizer
    workloads = {
        "grounded": grounded_prompts(tokenizer, max(args.batches)),
        "open": open_prompts(tokenizer, max(args.batches)),
    }
    rows = []
    for wname, prompts in workloads.items():
        for batch in args.batches:
            samples = {name: [] for name in args.methods}
            for _ in range(args.repeats):
                for name, llm in llms.items():
                    llm.engine.core.scheduler.spec_stats.__init__()
                    samples[name].append(run(llm, prompts[:batch], args.max_tokens))
            for name, rs in samples.items():
                tpot = statistics.median(r["tpot_ms"] for r in rs)
                tok_s = statistics.median(r["tok_s"] for r in rs)
                drafts, accepted = sum(r["drafts"] for r in rs), sum(r["accepted"] for r in rs)
                rate = accepted / drafts if drafts else float("nan")
                rows.append((wname, batch, name, tpot, tok_s, rate))
                print(
                    f"{wname:8s} batch {batch:2d} {name:5s}: TPOT {tpot:7.1f} ms  {tok_s:6.1f} tok/s  "
                    f"acceptance {rate:.2f}  (median of {args.repeats})",
                    flush=True,
                )
    print("\n| workload | batch | method | TPOT ms | out tok/s | acceptance |\n|---|---|---|---|---|---|")
    for w, b, m, t, s, a in sorted(rows, key=lambda x: (x[0], x[1])):
        print(f"| {w} | {b} | {m} | {t:.1f} | {s:.1f} | {'-' if a != a else f'{a:.2f}'} |")
    off = {(w, b): (t, s) for w, b, m, t, s, _ in rows if m == "off"}
    for w, b, m, t, s, _ in rows:
        if m != "off" and (w, b) in off:
            print(f"{w} batch {b} {m}: TPOT {off[w, b][0] / t:.2f}x lower, throughput {s / off[w, b][1]:.2f}x of off")


if __name__ == "__main__":
    main()
