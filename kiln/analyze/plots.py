"""The report's figures, drawn with matplotlib (Agg: no display needed).

Each function draws one PNG and returns its path, or None when there is
nothing to draw. Lines are drawn for at most `MAX_LINES` configurations
(the base, the recommendation, then the best scores); the tables hold all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.analyze.objective import Objective
from kiln.analyze.sweep import ConfigResult

MAX_LINES = 8
MIB = 2**20


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plotted(results: list[ConfigResult], base: ConfigResult | None, best: ConfigResult | None) -> list[ConfigResult]:
    """The configurations that get a line: base, best, then the highest scores."""
    measured = [r for r in results if r.points]
    chosen: list[ConfigResult] = []
    for r in (base, best):
        if r is not None and r.points and all(r is not c for c in chosen):  # the best may be the base
            chosen.append(r)
    for r in sorted(measured, key=lambda r: -r.score):
        if len(chosen) >= MAX_LINES:
            break
        if all(r is not c for c in chosen):
            chosen.append(r)
    return chosen


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def throughput_vs_latency(series: list[tuple[str, ConfigResult]], objective: Objective,
                          path: Path) -> Path | None:
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, r in series:
        ax.plot([p.p99_ms for p in r.points], [objective.throughput(p) for p in r.points], marker="o", label=label)
    if objective.max_p99_latency_ms is not None:
        ax.axvline(objective.max_p99_latency_ms, color="red", linestyle="--", label="p99 SLO")
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel(objective.unit)
    ax.set_title("Throughput vs p99 latency, per configuration (one point per load level)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def latency_vs_load(series: list[tuple[str, ConfigResult]], level_name: str, path: Path) -> Path | None:
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for (label, r), color in zip(series, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False):
        levels = [p.level for p in r.points]
        ax.plot(levels, [p.p99_ms for p in r.points], marker="o", color=color, label=f"{label} p99")
        ax.plot(levels, [p.p50_ms for p in r.points], linestyle=":", color=color, label=f"{label} p50")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(level_name)
    ax.set_ylabel("latency (ms)")
    ax.set_title(f"Latency percentiles vs {level_name} (solid p99, dotted p50)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, path)


def ttft_tpot_vs_rate(series: list[tuple[str, ConfigResult]], objective: Objective,
                      path: Path) -> Path | None:
    if not series or objective.kind != "llm":
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for label, r in series:
        rates = [p.level for p in r.points]
        left.plot(rates, [p.ttft_p99_ms or 0 for p in r.points], marker="o", label=label)
        right.plot(rates, [p.tpot_p99_ms or 0 for p in r.points], marker="o", label=label)
    for ax, name, limit in ((left, "p99 TTFT", objective.max_p99_ttft_ms),
                            (right, "p99 TPOT", objective.max_p99_tpot_ms)):
        if limit is not None:
            ax.axhline(limit, color="red", linestyle="--", label="SLO")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} vs request rate")
        ax.grid(alpha=0.3)
    left.legend(fontsize=6)
    return _save(fig, path)


def memory(series: list[tuple[str, ConfigResult]], path: Path) -> Path | None:
    rows = [(label, max((p.memory_bytes or 0 for p in r.points), default=0),
             max((p.model_memory_bytes or 0 for p in r.points), default=0)) for label, r in series]
    rows = [row for row in rows if row[1] or row[2]]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * len(rows) + 1.5))
    names = [row[0] for row in rows]
    ax.barh(names, [row[1] / MIB for row in rows], label="server processes (RSS, largest after a level)")
    if any(row[2] for row in rows):
        ax.barh(names, [row[2] / MIB for row in rows], height=0.4, label="engine: weights + KV pool")
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.set_title("Memory per configuration")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)
