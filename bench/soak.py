"""Soak: a live `kiln serve` under a bounded mix of good, rude and bad clients.

`--clients` workers loop until `--duration-s` is up, each time picking a kind
of request: OpenAI completions and chats (streamed and whole), KServe v2
infer on the llm model, streams the client cuts after a few events, impatient
clients that hang up before the answer, and bad inputs (numbers the engine
cannot hold, lone surrogates, deep JSON, a BYTES shape with no data, unknown
fields, ...) that must get a 4xx. Every request has a deadline (`--timeout-s`);
one that passes it without an answer is *lost*.

Then the server is left alone until nothing runs or waits; the report gives
RSS of the server and its engine process (at start, right after, at idle) and
the KV-cache use at idle (`kiln:kv_cache_usage_perc`, 0 when nothing leaked).
The engine faults its KV pool in while idle, so its RSS rises by the pool's
size in the first seconds after start whatever the load; put
`--no-warm-kv-pool` in `--serve-args` to read the growth of RSS alone.

    .venv/bin/python bench/soak.py --duration-s 600
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --server-pid 1234

Without `--url` it starts `kiln serve` (the default SmolLM2 model) with
`--serve-args`. Writes bench/results/soak-<time>.json. Exit status 1 when a
request was lost, an answer was unexpected (a 5xx, a 4xx to a good request,
a 2xx to a bad one, a broken stream, a dropped connection), or the server did
not go back to idle with its KV cache empty.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import random
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import corpus_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SERVE_ARGS = "--max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 512"
WEIGHTS = {"completion": 3, "completion_stream": 3, "chat": 2, "chat_stream": 2, "kserve": 2,
           "disconnect": 2, "impatient": 1, "bad_input": 3}
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Call:
    kind: str
    path: str
    body: bytes
    label: str = ""  # what a bad input is, for the report
    headers: dict = field(default_factory=lambda: JSON)
    stream: bool = False
    expect_4xx: bool = False
    cut_after_events: int | None = None  # hang up after this many stream events
    give_up_s: float | None = None  # an impatient client: hang up after this long


@dataclass(frozen=True)
class Outcome:
    status: int | None  # None: no answer came
    seconds: float
    error: str = ""  # what went wrong, for the report
    timed_out: bool = False  # the deadline passed without an answer
    cut: bool = False  # the client hung up on purpose


def classify(call: Call, outcome: Outcome) -> str:
    """ok | expected_4xx | cut | lost | unexpected."""
    if outcome.cut:
        return "cut"
    if outcome.timed_out:
        return "lost"
    if outcome.status is None or outcome.error:
        return "unexpected"
    if call.expect_4xx:
        return "expected_4xx" if 400 <= outcome.status < 500 else "unexpected"
    return "ok" if outcome.status == 200 else "unexpected"


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    ok_seconds: list[float] = field(default_factory=list)
    http_5xx: int = 0
    findings: list[dict] = field(default_factory=list)  # every lost or unexpected request

    def add(self, call: Call, outcome: Outcome) -> str:
        verdict = classify(call, outcome)
        self.counts[verdict] += 1
        self.by_kind.setdefault(call.kind, Counter())[verdict] += 1
        if verdict == "ok":
            self.ok_seconds.append(outcome.seconds)
        if outcome.status is not None and outcome.status >= 500:
            self.http_5xx += 1
        if verdict in ("lost", "unexpected"):
            self.findings.append({"verdict": verdict, "kind": call.kind, "label": call.label, "path": call.path,
                                  "status": outcome.status, "error": outcome.error,
                                  "seconds": round(outcome.seconds, 3),
                                  "body": call.body[:300].decode(errors="replace")})
        return verdict

    def summary(self) -> dict:
        ms = [s * 1000 for s in self.ok_seconds]
        return {"sent": sum(self.counts.values()),
                **{k: self.counts[k] for k in ("ok", "expected_4xx", "cut", "unexpected", "lost")},
                "http_5xx": self.http_5xx,
                "ok_p50_ms": percentile(ms, 50), "ok_p99_ms": percentile(ms, 99),
                "by_kind": {k: dict(v) for k, v in sorted(self.by_kind.items())},
                "findings": self.findings}


# ---- the requests -------------------------------------------------------------------


def _json(body: object) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as "\ud800"


@functools.cache
def bad_inputs(model: str) -> list[tuple[str, str, bytes, dict]]:
    """(label, path, body, headers) of requests that must be answered 4xx."""
    infer = f"/v2/models/{model}/infer"

    def completion(**extra) -> bytes:
        return _json({"model": model, "prompt": "x", "max_tokens": 2, **extra})

    def chat(content: str = "x", **extra) -> bytes:
        return _json({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})

    def text_input(*extra: dict, shape: list[int] | None = None) -> bytes:
        text = {"name": "text_input", "datatype": "BYTES", "shape": shape or [1], "data": ["x"]}
        return _json({"inputs": [text, *extra]})

    deep = b"[" * 100_000 + b"]" * 100_000
    bomb = _json({"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [2**28],
                              "parameters": {"binary_data_size": 0}}]})
    binary = {"content-type": "application/octet-stream", "Inference-Header-Content-Length": str(len(bomb))}
    return [(label, path, body, JSON) for label, path, body in [
        ("seed 2**64", "/v1/completions", completion(seed=2**64)),
        ("seed 2**64-1 with n 2", "/v1/completions", completion(seed=2**64 - 1, n=2)),
        ("top_k 2**63", "/v1/chat/completions", chat(top_k=2**63)),
        ("priority 2**64", "/v1/completions", completion(priority=2**64)),
        ("lone surrogate in stop", "/v1/completions", completion(stop=["\ud800"])),
        ("lone surrogate in chat content", "/v1/chat/completions", chat("\udc00")),
        ("lone surrogate to /tokenize", "/tokenize", _json({"model": model, "prompt": "a\ud800"})),
        ("stop_token_ids past the vocabulary", "/v1/completions", completion(stop_token_ids=[10**6])),
        ("logit_bias Infinity", "/v1/completions", completion(logit_bias={"5": math.inf})),
        ("n 10**9", "/v1/chat/completions", chat(n=10**9)),
        ("max_tokens 10**6", "/v1/completions", completion(max_tokens=10**6)),
        ("4000 prompts", "/v1/completions", _json({"model": model, "prompt": ["x"] * 4000, "max_tokens": 1})),
        ("unknown field", "/v1/completions", completion(frobnicate=True)),
        ("unknown field (chat)", "/v1/chat/completions", chat(temperatur=0.5)),
        ("JSON 100k deep (completions)", "/v1/completions", b'{"prompt": ' + deep + b"}"),
        ("JSON 100k deep (chat)", "/v1/chat/completions", b'{"messages": ' + deep + b"}"),
        ("JSON 100k deep (KServe)", infer, b'{"inputs": ' + deep + b"}"),
        ("truncated JSON", "/v1/completions", b'{"prompt": "x", "max_tokens": '),
        ("KServe BYTES shape [2**28] with no data (JSON)", infer, _json({"inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [2**28], "data": []}]})),
        ("KServe unknown input", infer, _json({"inputs": [
            {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}]})),
        ("KServe max_tokens as INT64", infer, text_input(
            {"name": "max_tokens", "datatype": "INT64", "shape": [1], "data": [2**40]})),
        ("KServe max_tokens 2**40 in INT32", infer, text_input(
            {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [2**40]})),
        ("KServe max_tokens 10**6", infer, text_input(
            {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [10**6]})),
        ("KServe max_tokens as FP32", infer, text_input(
            {"name": "max_tokens", "datatype": "FP32", "shape": [1], "data": [4.5]})),
        ("KServe shape/data mismatch", infer, text_input(shape=[3])),
    ]] + [("KServe binary BYTES shape [2**28] with no data", infer, bomb, binary)]


def make_call(kind: str, rng: random.Random, model: str, corpus: str) -> Call:
    start = rng.randrange(len(corpus) - 700)
    prompt = corpus[start : start + rng.randint(20, 600)]
    body: dict = {"model": model, "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**32)
    chat = kind.startswith("chat") or (kind == "disconnect" and rng.random() < 0.5)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if kind in ("completion", "chat"):
        return Call(kind, path, _json(body))
    if kind in ("completion_stream", "chat_stream"):
        return Call(kind, path, _json({**body, "stream": True}), stream=True)
    if kind == "disconnect":
        long = {**body, "stream": True, "max_tokens": rng.randint(64, 200), "ignore_eos": True}
        return Call(kind, path, _json(long), stream=True, cut_after_events=rng.randint(1, 8))
    if kind == "impatient":
        long = {**body, "max_tokens": rng.randint(64, 200), "ignore_eos": True}
        return Call(kind, path, _json(long), give_up_s=rng.uniform(0.1, 2.0))
    if kind == "kserve":
        infer = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [prompt]},
                            {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [body["max_tokens"]]}]}
        return Call(kind, f"/v2/models/{model}/infer", _json(infer))
    label, path, raw, headers = rng.choice(bad_inputs(model))
    return Call(kind, path, raw, label=label, headers=headers, expect_4xx=True)


async def send(client: httpx.AsyncClient, call: Call, timeout_s: float) -> Outcome:
    started = time.perf_counter()

    def done(status: int | None, error: str = "", **kw) -> Outcome:
        return Outcome(status, time.perf_counter() - started, error, **kw)

    status = None
    try:
        async with asyncio.timeout(call.give_up_s or timeout_s):
            async with client.stream("POST", call.path, content=call.body, headers=call.headers) as resp:
                status = resp.status_code
                if not call.stream or status != 200:
                    return done(status, _body_problem(call, status, await resp.aread()))
                events = 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return done(status)
                    if "error" in json.loads(data):
                        return done(status, f"error event: {data[:200]}")
                    events += 1
                    if call.cut_after_events is not None and events >= call.cut_after_events:
                        return done(status, cut=True)
                return done(status, "stream ended without [DONE]")
    except TimeoutError:
        if call.give_up_s is not None:
            return done(status, cut=True)
        return done(status, f"no answer within {timeout_s:g} s", timed_out=True)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return done(status, f"{type(e).__name__}: {e}")


def _body_problem(call: Call, status: int, raw: bytes) -> str:
    """Why an answer is wrong beyond its status ('' when it is not)."""
    if status >= 500 or (status == 200) == call.expect_4xx:
        return f"HTTP {status}: {raw[:300].decode(errors='replace')}"
    if status == 200:
        answer = json.loads(raw)
        if not (answer.get("choices") or answer.get("outputs")):
            return f"HTTP 200 without choices/outputs: {raw[:300].decode(errors='replace')}"
    return ""


# ---- the server ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(serve_args: list[str], log_path: Path, timeout_s: float = 600) -> Iterator[tuple[str, int]]:
    """`kiln serve` on a free port: (base URL, pid); SIGTERM (then SIGKILL) on exit, engine included."""
    port = free_port()
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", "--port", str(port), "--log-level", "warning", *serve_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kiln serve did not come up; see {log_path}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def rss_mib(pid: int | None) -> dict | None:
    """RSS of the server process and of its children (the engine process), MiB."""
    if pid is None:
        return None
    proc = psutil.Process(pid)
    children = sum(c.memory_info().rss for c in proc.children(recursive=True))
    return {"server": round(proc.memory_info().rss / 2**20, 1), "children": round(children / 2**20, 1)}


async def engine_gauges(client: httpx.AsyncClient) -> dict[str, float]:
    names = {"kiln:num_requests_running": "running", "kiln:num_requests_waiting": "waiting",
             "kiln:kv_cache_usage_perc": "kv_usage", "kiln:engine_restarts_total": "engine_restarts"}
    gauges = dict.fromkeys(names.values(), 0.0)
    for family in text_string_to_metric_families((await client.get("/metrics")).text):
        for sample in family.samples:
            if sample.name in names:
                gauges[names[sample.name]] += sample.value
    return gauges


async def wait_idle(client: httpx.AsyncClient, timeout_s: float, settle_s: float = 3.0) -> tuple[float | None, dict]:
    """Wait until nothing runs or waits, then `settle_s` more; (seconds it took or None, gauges)."""
    started = time.monotonic()
    while True:
        gauges = await engine_gauges(client)
        if gauges["running"] == gauges["waiting"] == 0:
            took = time.monotonic() - started
            await asyncio.sleep(settle_s)
            return round(took, 1), await engine_gauges(client)
        if time.monotonic() > started + timeout_s:
            return None, gauges
        await asyncio.sleep(0.5)


async def watch_engine(client: httpx.AsyncClient, peaks: dict, every_s: float = 5.0) -> None:
    """Peak requests in the engine while clients run: above --clients means hung-up requests linger."""
    while True:
        gauges = await engine_gauges(client)
        for key in ("running", "waiting", "kv_usage"):
            peaks[key] = max(peaks.get(key, 0.0), gauges[key])
        peaks["in_engine"] = max(peaks.get("in_engine", 0.0), gauges["running"] + gauges["waiting"])
        await asyncio.sleep(every_s)


# ---- the soak -----------------------------------------------------------------------


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s + 30, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = await send(client, make_call("completion", random.Random(0), model, corpus_text()), args.timeout_s)
        if warm.status != 200:
            raise SystemExit(f"warm-up request failed: {warm}")
        rss_start = rss_mib(pid)
        tally = Tally()
        corpus = corpus_text()
        kinds, weights = list(WEIGHTS), list(WEIGHTS.values())
        stop_at = time.monotonic() + args.duration_s

        async def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            while time.monotonic() < stop_at:
                call = make_call(rng.choices(kinds, weights)[0], rng, model, corpus)
                if tally.add(call, await send(client, call, args.timeout_s)) in ("lost", "unexpected"):
                    print(f"  finding: {tally.findings[-1]}", flush=True)

        peaks: dict[str, float] = {}
        watcher = asyncio.create_task(watch_engine(client, peaks))
        started = time.monotonic()
        await asyncio.gather(*(worker(i) for i in range(args.clients)))
        wall_s = time.monotonic() - started
        watcher.cancel()
        rss_after = rss_mib(pid)
        idle_after_s, gauges = await wait_idle(client, args.idle_timeout_s)
        return {"model": model, "url": url, "clients": args.clients, "duration_s": args.duration_s,
                "wall_s": round(wall_s, 1), "timeout_s": args.timeout_s, **tally.summary(),
                "rss_mib": {"start": rss_start, "after": rss_after, "idle": rss_mib(pid)},
                "peaks_during": peaks, "went_idle": idle_after_s is not None, "idle_after_s": idle_after_s,
                "idle_gauges": gauges}


def passed(report: dict) -> bool:
    gauges = report["idle_gauges"]
    return (report["lost"] == 0 and report["unexpected"] == 0 and report["http_5xx"] == 0
            and report["went_idle"] and gauges["kv_usage"] == 0)


def print_report(report: dict, path: Path) -> None:
    keys = ("sent", "ok", "expected_4xx", "cut", "unexpected", "http_5xx", "lost")
    print("  ".join(f"{k}={report[k]}" for k in keys))
    p50, p99 = report["ok_p50_ms"], report["ok_p99_ms"]
    print(f"good requests: p50 {p50 or 0:.0f} ms, p99 {p99 or 0:.0f} ms")
    for stage, rss in report["rss_mib"].items():
        print(f"RSS {stage}: {rss}")
    print(f"engine peaks while soaking: {report['peaks_during']}")
    print(f"idle after {report['idle_after_s']} s: {report['idle_gauges']}")
    print(f"by kind: {report['by_kind']}")
    print(f"wrote {path}; {'PASS' if passed(report) else 'FAIL'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="soak this server instead of starting one")
    ap.add_argument("--server-pid", type=int, help="with --url: the server's pid, for RSS")
    ap.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, help="flags of the `kiln serve` we start")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each request")
    ap.add_argument("--idle-timeout-s", type=float, default=120.0, help="how long the server may take to go idle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="report path (default bench/results/soak-<time>.json)")
    args = ap.parse_args(argv)
    if args.duration_s <= 0 or args.clients < 1 or args.timeout_s <= 0:
        ap.error("--duration-s, --clients and --timeout-s must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = args.out or RESULTS / f"soak-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.url:
            url, pid = args.url.rstrip("/"), args.server_pid
        else:
            url, pid = stack.enter_context(started_server(args.serve_args.split(), out.with_suffix(".log")))
        print(f"soaking {url} for {args.duration_s:g} s with {args.clients} clients", flush=True)
        report = asyncio.run(soak(args, url, pid))
    report["serve_args"] = None if args.url else args.serve_args
    report["date_utc"] = stamp
    out.write_text(json.dumps(report, indent=2))
    print_report(report, out)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
