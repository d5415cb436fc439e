"""`kiln bench serve` arguments and entry point."""

from __future__ import annotations

import argparse
import asyncio
import math
import os

from kiln.bench.client import Target
from kiln.bench.dataset import load_jsonl, synthetic
from kiln.bench.report import parse_slos, summarize, table, write_json
from kiln.bench.runner import LoadShape, run_load


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="model name the server knows")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=("random", "text", "jsonl"), default="text")
    p.add_argument("--dataset-path", help="JSONL file of {prompt, max_tokens} (with --dataset jsonl)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (synthetic)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens (synthetic)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by +- this fraction")
    p.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (inf: all at once)"
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument(
        "--exact-output-len",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send min_tokens=max_tokens and ignore_eos (servers that support them)",
    )
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:3000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--result-json", help="write the summary here")


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.dataset == "jsonl":
        if not args.dataset_path:
            raise SystemExit("--dataset jsonl needs --dataset-path")
        items = load_jsonl(args.dataset_path, args.output_len)[: args.num_prompts]
    else:
        items = synthetic(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    target = Target(args.base_url, args.model, args.endpoint, args.api_key, args.exact_output_len)
    shape = LoadShape(args.request_rate, args.max_concurrency, args.seed)
    slos = parse_slos(args.goodput)
    results, duration = asyncio.run(run_load(target, items, shape, args.timeout, args.warmup))
    summary = summarize(results, duration, slos)
    title = f"rate={args.request_rate} concurrency={args.max_concurrency}"
    print(table(summary, title))
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
        config["request_rate"] = str(config["request_rate"])
        write_json(args.result_json, summary, config)
    return 0 if summary["completed"] else 1
