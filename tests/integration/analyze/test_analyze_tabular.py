"""`kiln analyze` end to end on the tabular example, the way a user runs it:
interrupted with Ctrl-C after the first measurement (the report of what was
measured is written, no server is left), then run again to resume (nothing
measured twice) to a recommendation, a valid config.yaml and a report with
its plots."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytest.importorskip("sklearn")
pytest.importorskip("skl2onnx")
pytest.importorskip("matplotlib")

from kiln.serving.repository.config import parse_config  # noqa: E402
from tests.integration.kserve.live import ROOT  # noqa: E402


def _build(dest: Path) -> Path:
    path = ROOT / "examples" / "tabular" / "build_repository.py"
    spec = importlib.util.spec_from_file_location("tabular_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(dest)


def _analyze(repo: Path, output: Path) -> list[str]:
    return [sys.executable, "-m", "kiln.cli.main", "analyze", "--model-repository", str(repo),
            "--model-name", "breast_cancer", "--output", str(output),
            "--param", "max_batch_size=8,64", "--param", "max_queue_delay_ms=0,2",
            "--concurrency", "1,4", "--level-duration-s", "0.5", "--max-p99-latency-ms", "1000",
            "--price-per-hour", "2.0"]


def _point_keys(results: Path) -> list[tuple[str, float]]:
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    return [(json.dumps(r["config"], sort_keys=True), r["level"]) for r in lines if r["kind"] == "point"]


def test_interrupt_then_resume_to_a_recommendation(tmp_path):
    repo = _build(tmp_path / "repo")
    output = tmp_path / "analysis"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(_analyze(repo, output), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    results = output / "results.jsonl"
    deadline = time.monotonic() + 120
    while not (results.is_file() and _point_keys(results)):
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        assert time.monotonic() < deadline, "no point measured in 120 s"
        time.sleep(0.1)
    servers = [p for p in psutil.Process(first.pid).children(recursive=True) if "serve" in p.cmdline()]
    first.send_signal(signal.SIGTERM)  # as `kill` or a CI timeout stops it (SIGINT takes the same path)
    assert first.wait(timeout=60) == 130, (tmp_path / "first.log").read_text()
    text = (tmp_path / "first.log").read_text()
    assert "interrupted: run the same command again to resume" in text
    assert "interrupted" in (output / "report.md").read_text()
    assert servers and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers)
    measured_first = _point_keys(results)

    second = subprocess.run(_analyze(repo, output), capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert second.returncode == 0, second.stdout + second.stderr
    keys = _point_keys(results)
    assert keys[: len(measured_first)] == measured_first and len(set(keys)) == len(keys)  # resumed, not repeated
    assert "(measured earlier)" in second.stderr

    written = yaml.safe_load((output / "config.yaml").read_text())
    config = parse_config(written, name="breast_cancer")  # ready to use
    assert config.max_batch_size in (8, 64) and config.dynamic_batching.max_queue_delay_ms in (0, 2)
    assert "recommended: " in second.stdout
    markdown = (output / "report.md").read_text()
    for plot in ("throughput_latency.png", "latency_vs_load.png", "memory.png"):
        assert (output / "plots" / plot).stat().st_size > 5000
        assert f"plots/{plot}" in markdown
    page = (output / "report.html").read_text()
    assert page.count("src='data:image/png;base64,") == 3 and "$ per 1k" in page
