"""`kiln bench serve` arguments and entry point."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from pathlib import Path

import httpx

from kiln.bench.client import Target
from kiln.bench.dataset import load_jsonl, synthetic
from kiln.bench.report import parse_slos, summarize, table, write_json
from kiln.bench.runner import LoadShape, run_load
from kiln.errors import KilnError


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


def check_bench_serve_args(args: argparse.Namespace) -> dict[str, float]:
    """Every number in range and every path usable before the first request (a rate of 0 was a
    ZeroDivisionError, a bad --result-json failed after the whole run); returns the SLOs."""
    def bad(message: str) -> KilnError:
        return KilnError(message)

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise bad(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        raise bad(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if not args.request_rate > 0:  # inf: all at once
        raise bad(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise bad(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.warmup < 0:
        raise bad(f"--warmup must be non-negative, got {args.warmup}")
    if not 0 < args.timeout < math.inf:
        raise bad(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.dataset == "jsonl" and not args.dataset_path:
        raise bad("--dataset jsonl needs --dataset-path")
    if args.dataset_path and not Path(args.dataset_path).is_file():
        raise bad(f"--dataset-path {args.dataset_path!r} is not a file")
    if args.result_json and not Path(args.result_json).resolve().parent.is_dir():
        raise bad(f"--result-json {args.result_json!r}: its directory does not exist")
    try:
        slos = parse_slos(args.goodput)
    except ValueError as exc:
        raise bad(f"--goodput: {exc}") from None
    if not all(0 < v < math.inf for v in slos.values()):
        raise bad(f"--goodput: SLOs must be positive milliseconds, got {args.goodput}")
    return slos


def check_reachable(base_url: str) -> None:
    """A server that does not answer at all fails the command, not every prompt in turn."""
    try:
        httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10)
    except (httpx.HTTPError, ValueError) as exc:
        raise KilnError(f"cannot reach {base_url}: {exc}") from None


def run_bench_serve(args: argparse.Namespace) -> int:
    slos = check_bench_serve_args(args)
    if args.dataset == "jsonl":
        try:
            items = load_jsonl(args.dataset_path, args.output_len)[: args.num_prompts]
        except (ValueError, OSError) as exc:
            raise KilnError(f"--dataset-path {args.dataset_path!r}: {exc}") from None
    else:
        items = synthetic(args.dataset, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    check_reachable(args.base_url)
    target = Target(args.base_url, args.model, args.endpoint, args.api_key, args.exact_output_len)
    shape = LoadShape(args.request_rate, args.max_concurrency, args.seed)
    results, duration = asyncio.run(run_load(target, items, shape, args.timeout, args.warmup))
    summary = summarize(results, duration, slos)
    title = f"rate={args.request_rate} concurrency={args.max_concurrency}"
    print(table(summary, title))
    if args.result_json:
        config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
        config["request_rate"] = str(config["request_rate"])
        write_json(args.result_json, summary, config)
    return 0 if summary["completed"] else 1
