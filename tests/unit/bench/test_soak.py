"""bench/soak.py's bookkeeping: how each answer is judged and tallied, and that
the requests it sends are what they claim to be (good bodies pass Kiln's own
request models, bad ones fail them). The soak itself needs a live server."""
import json
import random
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import soak  # noqa: E402

GOOD = soak.Call("completion", "/v1/completions", b"{}")
BAD = soak.Call("bad_input", "/v1/completions", b'{"seed": 1}', label="seed", expect_4xx=True)


@pytest.mark.parametrize(
    "call,outcome,verdict",
    [
        (GOOD, soak.Outcome(200, 0.1), "ok"),
        (GOOD, soak.Outcome(400, 0.1, "HTTP 400: ..."), "unexpected"),
        (GOOD, soak.Outcome(500, 0.1, "HTTP 500: ..."), "unexpected"),
        (GOOD, soak.Outcome(None, 0.1, "ReadError: ..."), "unexpected"),
        (GOOD, soak.Outcome(200, 0.1, "stream ended without [DONE]"), "unexpected"),
        (GOOD, soak.Outcome(None, 120.0, "no answer within 120 s", timed_out=True), "lost"),
        (GOOD, soak.Outcome(200, 120.0, "no answer within 120 s", timed_out=True), "lost"),  # a stream that stalled
        (GOOD, soak.Outcome(200, 0.3, cut=True), "cut"),
        (BAD, soak.Outcome(400, 0.1), "expected_4xx"),
        (BAD, soak.Outcome(431, 0.1), "expected_4xx"),
        (BAD, soak.Outcome(200, 0.1, "HTTP 200: ..."), "unexpected"),
        (BAD, soak.Outcome(503, 0.1, "HTTP 503: ..."), "unexpected"),
    ],
)
def test_classify(call, outcome, verdict):
    assert soak.classify(call, outcome) == verdict


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(100, 0, -1)]
    assert (soak.percentile(values, 50), soak.percentile(values, 99), soak.percentile(values, 100)) == (50, 99, 100)
    assert soak.percentile([7.0], 99) == 7.0 and soak.percentile([], 50) is None


def test_tally_counts_verdicts_latencies_and_findings():
    tally = soak.Tally()
    for seconds in (0.1, 0.2, 0.3, 0.4):
        tally.add(GOOD, soak.Outcome(200, seconds))
    tally.add(BAD, soak.Outcome(400, 0.01))
    tally.add(BAD, soak.Outcome(500, 0.01, "HTTP 500: boom"))
    tally.add(GOOD, soak.Outcome(None, 120.0, "no answer", timed_out=True))
    summary = tally.summary()
    assert {k: summary[k] for k in ("sent", "ok", "expected_4xx", "cut", "unexpected", "http_5xx", "lost")} == {
        "sent": 7, "ok": 4, "expected_4xx": 1, "cut": 0, "unexpected": 1, "http_5xx": 1, "lost": 1}
    assert summary["ok_p50_ms"] == pytest.approx(200) and summary["ok_p99_ms"] == pytest.approx(400)
    assert summary["by_kind"] == {"bad_input": {"expected_4xx": 1, "unexpected": 1}, "completion": {"ok": 4, "lost": 1}}
    assert [(f["verdict"], f["label"], f["status"], f["body"]) for f in summary["findings"]] == [
        ("unexpected", "seed", 500, '{"seed": 1}'), ("lost", "", None, "{}")]


def report(**changes) -> dict:
    base = {"lost": 0, "unexpected": 0, "http_5xx": 0, "went_idle": True, "idle_gauges": {"kv_usage": 0.0}}
    return {**base, **changes}


def test_a_soak_passes_only_with_nothing_lost_unexpected_or_leaked():
    assert soak.passed(report())
    assert not soak.passed(report(lost=1))
    assert not soak.passed(report(unexpected=1))
    assert not soak.passed(report(went_idle=False))
    assert not soak.passed(report(idle_gauges={"kv_usage": 0.01}))


def test_good_requests_pass_kilns_request_models_and_bad_ones_are_marked():
    rng = random.Random(0)
    corpus = soak.corpus_text()
    models: dict[str, type[SamplingFields]] = {"/v1/completions": CompletionRequest,
                                               "/v1/chat/completions": ChatCompletionRequest}
    for _ in range(200):
        kind = rng.choice(list(soak.WEIGHTS))
        call = soak.make_call(kind, rng, "m", corpus)
        assert call.expect_4xx == (kind == "bad_input")
        if not call.expect_4xx and call.path in models:
            body = models[call.path].model_validate_json(call.body)
            assert body.stream == call.stream
        assert (call.cut_after_events is not None) == (kind == "disconnect")
        assert (call.give_up_s is not None) == (kind == "impatient")


# what the request models alone refuse; the rest (vocabulary, max_n, the context, KServe) the server does
REFUSED_BY_THE_MODELS = ["seed 2**64", "seed 2**64-1 with n 2", "top_k 2**63", "priority 2**64",
                         "lone surrogate in stop", "lone surrogate in chat content", "logit_bias Infinity",
                         "unknown field", "unknown field (chat)"]


@pytest.mark.parametrize("label", REFUSED_BY_THE_MODELS)
def test_bad_inputs_are_bad(label):
    (path, body), = [(p, b) for lbl, p, b, _ in soak.bad_inputs("m") if lbl == label]
    model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
    with pytest.raises((ValidationError, KilnError)):
        model.model_validate(json.loads(body))
