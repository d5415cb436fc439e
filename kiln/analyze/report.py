"""The analyzer's report: the recommendation against the base configuration,
every configuration measured, every point, the plots and the search's
decisions; written as report.md (PNGs beside it) and report.html (one file).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

from kiln.analyze import plots
from kiln.analyze.document import Block, Code, Heading, Image, Paragraph, Table, to_html, to_markdown
from kiln.analyze.objective import Objective, Point, cost_per_1k
from kiln.analyze.progress import describe_config
from kiln.analyze.search import SearchOutcome
from kiln.analyze.space import SearchSpace
from kiln.analyze.sweep import ConfigResult

MIB = 2**20


@dataclass
class RunSummary:
    model: str
    kind: str
    space: SearchSpace
    objective: Objective
    workload: dict
    level_name: str
    search: str
    outcome: SearchOutcome
    elapsed_s: float
    measured_now: int
    measured_before: int
    price_per_hour: float | None
    files: list[Path] = field(default_factory=list)
    command: str = ""


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def predictions_per_s(point: Point, kind: str) -> float:
    return point.throughput_rps if kind == "llm" else point.inferences_per_s


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _cost(summary: RunSummary, point: Point | None) -> str:
    if point is None:
        return "-"
    value = cost_per_1k(summary.price_per_hour, predictions_per_s(point, summary.kind))
    return "-" if value is None else f"${value:.5f}"


def _latency(summary: RunSummary, point: Point | None) -> str:
    if point is None:
        return "-"
    if summary.kind == "llm":
        return f"TTFT {_fmt(point.ttft_p99_ms, 0)} / TPOT {_fmt(point.tpot_p99_ms)} / e2e {_fmt(point.p99_ms, 0)}"
    return f"{point.p50_ms:.2f} / {point.p99_ms:.2f}"


def _memory(result: ConfigResult) -> str:
    rss = max((p.memory_bytes or 0 for p in result.points), default=0)
    held = max((p.model_memory_bytes or 0 for p in result.points), default=0)
    text = f"{rss / MIB:.0f}" if rss else "-"
    return text + (f" ({held / MIB:.0f} engine)" if held else "")


def labels(summary: RunSummary) -> dict[int, str]:
    """A short name per measured configuration: base, recommended, #n."""
    out = {}
    for number, result in enumerate(summary.outcome.results, 1):
        name = f"#{number} " + describe_config(result.config, summary.space.base)
        if result is summary.outcome.base:
            name = "base"
        if result is summary.outcome.best and result is not summary.outcome.base:
            name = "recommended: " + describe_config(result.config, summary.space.base)
        out[id(result)] = name
    return out


def _recommendation(summary: RunSummary) -> list[Block]:
    outcome, objective = summary.outcome, summary.objective
    base, best = outcome.base, outcome.best
    blocks: list[Block] = [Heading(2, "Recommendation")]
    if best is None:
        blocks.append(Paragraph("**No configuration met the objective** at any load level measured: loosen the SLOs, "
                                "add lower load levels, or look at the failures below."))
        return blocks
    if best is base:
        blocks.append(Paragraph("**Keep the base configuration**: no configuration measured beat it by more than "
                                "the noise margin (2%)."))
    else:
        changes = [f"`{k}`: {base.config[k] if base else '?'} -> **{v}**" for k, v in best.config.items()
                   if base is None or base.config.get(k) != v]
        blocks.append(Paragraph("**Change** " + "; ".join(changes) + "."))
    rows = [["throughput (" + objective.unit + ")", _fmt(base.score if base else None), _fmt(best.score),
             _gain(base.score if base else None, best.score)],
            ["at load level (" + summary.level_name + ")", _fmt(base.best.level if base and base.best else None, 2),
             _fmt(best.best.level if best.best else None, 2), ""],
            ["p50 / p99 latency at that level (ms)" if summary.kind != "llm" else "p99 TTFT / TPOT / e2e (ms)",
             _latency(summary, base.best if base else None), _latency(summary, best.best), ""],
            ["cost per 1,000 predictions", _cost(summary, base.best if base else None), _cost(summary, best.best), ""],
            ["memory (MiB, server RSS)", _memory(base) if base else "-", _memory(best), ""]]
    blocks.append(Table(["", "base", "recommended", "change"], rows))
    if summary.files:
        blocks.append(Paragraph("Ready to use: " + ", ".join(f"`{p.name}`" for p in summary.files) + " (beside "
                                "this report)."))
    return blocks


def _gain(before: float | None, after: float | None) -> str:
    if not before or after is None:
        return ""
    return f"{(after / before - 1) * 100:+.1f}%"


def _configs_table(summary: RunSummary, names: dict[int, str]) -> Table:
    rows = []
    for result in summary.outcome.results:
        best = result.best
        rows.append([
            names[id(result)], _fmt(result.score) if not result.invalid else "-",
            _fmt(best.level, 2) if best else "-", _fmt(best.throughput_rps) if best else "-",
            _latency(summary, best), _memory(result), _cost(summary, best),
            f"${best.server_cost_per_1k_usd:.5f}" if best and best.server_cost_per_1k_usd is not None else "-",
            result.invalid or result.stop_reason + ("" if result.complete else " (interrupted)"),
        ])
    latency = "p99 TTFT / TPOT / e2e ms" if summary.kind == "llm" else "p50 / p99 ms"
    return Table(["configuration", summary.objective.unit, summary.level_name, "requests/s", latency,
                  "memory MiB", "$ per 1k (price / throughput)", "$ per 1k (server gauge)", "sweep"], rows)


def _points_table(summary: RunSummary, names: dict[int, str]) -> Table:
    rows = []
    for result in summary.outcome.results:
        for p in result.points:
            extra = ([_fmt(p.ttft_p50_ms, 0), _fmt(p.ttft_p99_ms, 0), _fmt(p.tpot_p50_ms), _fmt(p.tpot_p99_ms)]
                     if summary.kind == "llm" else [])
            rows.append([names[id(result)], f"{p.level:g}", f"{p.duration_s:.1f}", str(p.requests), str(p.errors),
                         _fmt(summary.objective.throughput(p)), _fmt(p.throughput_rps), _fmt(p.p50_ms, 2),
                         _fmt(p.p90_ms, 2), _fmt(p.p99_ms, 2), *extra,
                         _fmt(p.memory_bytes / MIB if p.memory_bytes else None, 0)])
    extra_head = ["TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"] if summary.kind == "llm" else []
    return Table(["configuration", summary.level_name, "seconds", "requests", "errors", summary.objective.unit,
                  "requests/s", "p50 ms", "p90 ms", "p99 ms", *extra_head, "RSS MiB"], rows)


def _plots(summary: RunSummary, names: dict[int, str], directory: Path) -> list[Block]:
    outcome = summary.outcome
    chosen = plots.plotted(outcome.results, outcome.base, outcome.best)
    series = [(names[id(r)], r) for r in chosen]
    plot_dir = directory / "plots"
    plot_dir.mkdir(exist_ok=True)
    drawn = [
        ("Throughput vs p99 latency per configuration",
         plots.throughput_vs_latency(series, summary.objective, plot_dir / "throughput_latency.png")),
        (f"Latency percentiles vs {summary.level_name}",
         plots.latency_vs_load(series, summary.level_name, plot_dir / "latency_vs_load.png")),
        ("TTFT and TPOT vs request rate",
         plots.ttft_tpot_vs_rate(series, summary.objective, plot_dir / "ttft_tpot_vs_rate.png")),
        ("Memory per configuration", plots.memory(series, plot_dir / "memory.png")),
    ]
    return [Image(title, path) for title, path in drawn if path is not None]


def build(summary: RunSummary, directory: Path) -> list[Block]:
    outcome = summary.outcome
    names = labels(summary)
    status = {"interrupted": " (interrupted: the report covers what was measured)",
              "budget": " (stopped at --max-configs)"}.get(outcome.stopped, "")
    points = sum(len(r.points) for r in outcome.results)
    blocks: list[Block] = [
        Heading(1, f"kiln analyze: {summary.model}"),
        Paragraph(f"**Objective**: {summary.objective.describe()}. **Model kind**: {summary.kind}. "
                  f"**Search**: {summary.search}{status}."),
        Paragraph(f"**Workload**: {', '.join(f'{k}={v}' for k, v in summary.workload.items())}."),
        Paragraph(f"**Run**: {summary.elapsed_s:.0f} s on {machine()}; {len(outcome.results)} configurations, "
                  f"{points} load levels ({summary.measured_now} measured now, {summary.measured_before} read from "
                  f"an earlier run); the full grid has {summary.space.size()} configurations."),
    ]
    if summary.price_per_hour is not None:
        blocks.append(Paragraph(f"**Price**: ${summary.price_per_hour:g}/hour. Cost per 1,000 predictions = "
                                "1000 x price / 3600 / predictions per second at the configuration's best level "
                                "(a server kept that busy); the server's own gauge is shown beside it."))
    if summary.command:
        blocks.append(Code(summary.command))
    blocks += _recommendation(summary)
    blocks += [Heading(2, "Configurations"), _configs_table(summary, names)]
    blocks += [Heading(2, "Plots"), *_plots(summary, names, directory)]
    blocks += [Heading(2, "Every load level measured"), _points_table(summary, names)]
    blocks += [Heading(2, "Search space"),
               Table(["parameter", "values", "base"],
                     [[p.name, ", ".join(str(v) for v in p.values), str(summary.space.base[p.name])]
                      for p in summary.space.params])]
    if outcome.trace:
        blocks += [Heading(2, "Search decisions"), Code("\n".join(outcome.trace))]
    return blocks


def write(summary: RunSummary, directory: Path) -> tuple[Path, Path]:
    blocks = build(summary, directory)
    markdown, page = directory / "report.md", directory / "report.html"
    markdown.write_text(to_markdown(blocks, directory))
    page.write_text(to_html(blocks, f"kiln analyze: {summary.model}"))
    return markdown, page
