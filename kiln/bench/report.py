"""Summary of a benchmark run: throughput, latency percentiles, goodput.

Latencies are reported in milliseconds. Goodput counts completed requests
that met every SLO given (`ttft:500 tpot:50 e2el:3000`, milliseconds).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kiln.bench.client import RequestResult

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


def parse_slos(specs: list[str]) -> dict[str, float]:
    slos = {}
    for spec in specs:
        key, _, value = spec.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"bad SLO {spec!r}; expected one of {SLO_KEYS} as key:milliseconds")
        slos[key] = float(value)
    return slos


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {"mean": statistics.fmean(ms) if ms else 0.0}
    out.update({f"p{p}": percentile(ms, p) for p in PERCENTILES})
    return out


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(values[k] * 1000 <= limit for k, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution([x for r in ok for x in r.itls]),
        "e2el_ms": distribution([r.e2e for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if slos:
        good = [r for r in ok if meets(r, slos)]
        summary["slos_ms"] = slos
        summary["goodput"] = len(good) / duration_s if duration_s else 0.0
        summary["good_fraction"] = len(good) / len(results) if results else 0.0
    return summary


def table(summary: dict, title: str) -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    if "goodput" in summary:
        rows.append(("Goodput (req/s)", f"{summary['goodput']:.2f}"))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency")):
        for stat, value in summary[key].items():
            rows.append((f"{stat.capitalize() if stat == 'mean' else stat.upper()} {name} (ms)", f"{value:.2f}"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{'=' * 12} {title} {'=' * 12}"]
    lines += [f"{name:<{width}}{value:>12}" for name, value in rows]
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def write_json(path: str | Path, summary: dict, config: dict) -> None:
    Path(path).write_text(json.dumps({"config": config, "results": summary}, indent=2) + "\n")
