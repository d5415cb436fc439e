"""The benchmark client's pieces: workloads, arrivals, statistics."""

from __future__ import annotations

import json

import pytest

from kiln.bench.client import RequestResult, Target
from kiln.bench.dataset import WorkItem, load_jsonl, synthetic
from kiln.bench.report import parse_slos, percentile, summarize, table
from kiln.bench.runner import arrival_gaps


def test_synthetic_workloads_are_seeded():
    a = synthetic("text", 5, 20, 8, 0.5, seed=1)
    assert a == synthetic("text", 5, 20, 8, 0.5, seed=1)
    assert a != synthetic("text", 5, 20, 8, 0.5, seed=2)
    assert all(10 <= len(i.prompt.split()) <= 30 and 4 <= i.max_tokens <= 12 for i in a)
    fixed = synthetic("random", 3, 16, 8, 0.0, seed=0)
    assert all(len(i.prompt.split()) == 16 and i.max_tokens == 8 for i in fixed)


def test_jsonl_workload(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "a", "max_tokens": 3}) + "\n\n" + json.dumps({"prompt": "b"}) + "\n")
    assert load_jsonl(path, 7) == [WorkItem("a", 3), WorkItem("b", 7)]


def test_poisson_gaps_have_the_right_mean():
    gaps = arrival_gaps(4000, rate=4.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    assert arrival_gaps(3, float("inf"), 0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5
    assert percentile([], 90) == 0.0


def test_summary_throughput_latency_and_goodput():
    fast = RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.1, e2e=1.1, itls=[0.1] * 10)
    slow = RequestResult(ok=True, prompt_tokens=10, output_tokens=11, ttft=0.9, e2e=2.9, itls=[0.2] * 10)
    failed = RequestResult(ok=False, error="HTTP 503")
    s = summarize([fast, slow, failed], duration_s=2.0, slos=parse_slos(["ttft:500", "tpot:150"]))
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (2, 1, 22)
    assert s["output_throughput"] == 11.0 and s["request_throughput"] == 1.0
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)
    assert s["goodput"] == 0.5  # only `fast` meets both SLOs
    assert s["errors"] == ["HTTP 503"]
    assert "Goodput" in table(s, "t")


def test_bad_slo_is_refused():
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


def test_request_body_asks_for_exact_lengths():
    body = Target("http://x", "m").body(WorkItem("p", 9))
    assert body["min_tokens"] == body["max_tokens"] == 9 and body["ignore_eos"] and body["stream"]
    chat = Target("http://x", "m", endpoint="chat", exact_output_len=False).body(WorkItem("p", 9))
    assert chat["messages"][0]["content"] == "p" and "ignore_eos" not in chat
