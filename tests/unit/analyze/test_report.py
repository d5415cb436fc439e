"""The report: recommendation against the base, tables, plots (PNG files, and data URIs in the HTML)."""

from __future__ import annotations

import pytest

from kiln.analyze import report
from kiln.analyze.objective import Objective, Point
from kiln.analyze.plots import MAX_LINES, plotted
from kiln.analyze.search import SearchOutcome
from kiln.analyze.space import Param, SearchSpace
from kiln.analyze.sweep import ConfigResult

pytest.importorskip("matplotlib")

SPACE = SearchSpace("llm", (Param("max_num_seqs", (16, 64), True, ""),), {"max_num_seqs": 16})


def _result(seqs: int, tokens: list[float]) -> ConfigResult:
    points = [Point(level=rate, requests=20, throughput_rps=t / 64, output_tokens_per_s=t, p50_ms=900, p99_ms=1500,
                    ttft_p50_ms=80, ttft_p99_ms=150 * rate, tpot_p50_ms=20, tpot_p99_ms=30, memory_bytes=700 * 2**20,
                    model_memory_bytes=300 * 2**20) for rate, t in zip((1.0, 2.0), tokens, strict=True)]
    best = max(points, key=lambda p: p.output_tokens_per_s)
    return ConfigResult({"max_num_seqs": seqs}, points, best, best.output_tokens_per_s, "all levels measured")


def _summary(outcome: SearchOutcome) -> report.RunSummary:
    return report.RunSummary(
        model="smollm2", kind="llm", space=SPACE, objective=Objective("llm", max_p99_ttft_ms=1000),
        workload={"levels": [1.0, 2.0]}, level_name="request rate", search="coordinate", outcome=outcome,
        elapsed_s=12.0, measured_now=4, measured_before=0, price_per_hour=3.6)


def test_report_compares_the_recommendation_with_the_base(tmp_path):
    base, other = _result(16, [64.0, 100.0]), _result(64, [64.0, 128.0])
    outcome = SearchOutcome([base, other], base=base, best=other)
    markdown, page = report.write(_summary(outcome), tmp_path)
    text = markdown.read_text()
    assert "**Change** `max_num_seqs`: 16 -> **64**." in text
    assert "| throughput (output tokens/s) | 100.0 | 128.0 | +28.0% |" in text
    # 128 tokens/s at 64 tokens per request = 2 requests/s; $3.60/h = $0.001/s -> $0.0005 per request
    assert "| cost per 1,000 predictions | $0.64000 | $0.50000 |  |" in text
    assert ("| recommended: max_num_seqs=64 | 128.0 | 2.00 | 2.0 | TTFT 300 / TPOT 30.0 / e2e 1500 | 700 (300 engine) "
            "| $0.50000 | - | all levels measured |") in text
    for plot in ("throughput_latency", "latency_vs_load", "ttft_tpot_vs_rate", "memory"):
        assert (tmp_path / "plots" / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"
        assert f"](plots/{plot}.png)" in text
    html = page.read_text()
    assert html.count("src='data:image/png;base64,iVBOR") == 4  # self-contained
    assert "<td>$0.50000</td>" in html


def test_report_of_an_interrupted_run_with_nothing_feasible(tmp_path):
    partial = _result(16, [64.0, 100.0])
    partial.complete, partial.best, partial.score = False, None, 0.0
    outcome = SearchOutcome([partial], base=None, best=None, stopped="interrupted")
    markdown, _ = report.write(_summary(outcome), tmp_path)
    text = markdown.read_text()
    assert "(interrupted: the report covers what was measured)" in text
    assert "**No configuration met the objective**" in text
    assert "all levels measured (interrupted)" in text


def test_plots_draw_each_configuration_once_when_the_base_is_best():
    results = [ConfigResult({"b": i}, points=[Point(level=1.0)], score=float(i)) for i in range(MAX_LINES + 2)]
    base = best = results[-1]
    chosen = plotted(results, base, best)
    assert chosen[0] is base and len(chosen) == MAX_LINES == len({id(r) for r in chosen})
    assert [r.score for r in chosen] == sorted((r.score for r in results), reverse=True)[:MAX_LINES]
