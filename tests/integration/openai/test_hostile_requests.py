"""Requests that once wedged, killed or stalled a live server (issue 17), sent
to a live `kiln serve` with its engine in its own process: each now gets a
4xx naming what is wrong, and the same engine (same PID) goes on serving.

Limits here: --max-queued-requests 8 with room for 128 running,
--timeout-header-s 1 and --timeout-idle-s 1 (so the slow-client cases are quick).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import psutil
import pytest

from tests.integration.openai.live import kiln_server

U64_PAST = 18446744073709551616


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    flags = ["--num-blocks", "256", "--served-model-name", "tiny", "--max-queued-requests", "8",
             "--timeout-header-s", "1", "--timeout-idle-s", "1", "--timeout-body-s", "2"]
    with kiln_server(tiny_llama_dir, *flags, tmp_dir=tmp_path_factory.mktemp("hostile")) as s:
        s.first_engine_pid = s.engine_pid()
        yield s


def completes(server) -> None:
    """A normal request is served, promptly, by the engine the server started with."""
    r = httpx.post(server.base_url + "/v1/completions", timeout=20,
                   json={"prompt": "Still there?", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.engine_pid() == server.first_engine_pid


WEDGERS = [
    ({"seed": U64_PAST}, "seed"),
    ({"priority": U64_PAST}, "priority"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"stop": ["\ud800"]}, "stop.0"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),  # past the vocabulary
    ({"top_k": 9223372036854775808}, "top_k"),
    ({"logit_bias": {"5": float("inf")}}, "logit_bias.5"),
]


@pytest.mark.parametrize("extra,param", WEDGERS, ids=[p for _, p in WEDGERS])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_values_that_once_wedged_or_killed_the_engine_are_400(server, route, extra, param):
    body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    raw = json.dumps({**body, "max_tokens": 2, **extra}, ensure_ascii=True).encode()
    r = httpx.post(server.base_url + route, content=raw, timeout=20, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    completes(server)


def test_hostile_requests_in_flight_beside_good_ones_hurt_none_of_them(server):
    """Every wedger, on both routes, sent at once with well-formed requests: each
    hostile one is a 400 naming its field, each good one gets the text it gets alone."""
    good = {"prompt": "The cat", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = server.post("/v1/completions", json=good).json()["choices"][0]["text"]

    def hostile(route: str, extra: dict) -> bytes:
        body = {"prompt": "x"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
        return json.dumps({**body, "max_tokens": 2, **extra}, ensure_ascii=True).encode()

    sent = [(route, hostile(route, extra), param) for extra, param in WEDGERS
            for route in ("/v1/completions", "/v1/chat/completions")]

    async def together():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60,
                                     headers={"content-type": "application/json"}) as client:
            bad = [client.post(route, content=raw) for route, raw, _ in sent]
            fine = [client.post("/v1/completions", json=good) for _ in range(4)]
            answers = await asyncio.gather(*bad, *fine)
            return answers[:len(bad)], answers[len(bad):]

    bad, fine = asyncio.run(together())
    for (route, _, param), r in zip(sent, bad, strict=True):
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, param, r.text)
    assert [r.status_code for r in fine] == [200] * 4
    assert [r.json()["choices"][0]["text"] for r in fine] == [alone] * 4
    completes(server)


@pytest.mark.parametrize(
    "route,raw",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}'),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
        ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("/tokenize", b"[" * 100_000 + b"]" * 100_000),
        ("/detokenize", b'{"tokens": ' + b"[" * 150 + b"]" * 150 + b"}"),
    ],
)
def test_lone_surrogates_and_deep_json_are_400_not_500(server, route, raw):
    r = httpx.post(server.base_url + route, content=raw, timeout=20, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "UTF-8" in message or "nesting depth" in message, message


def test_one_request_cannot_carry_thousands_of_prompts(server):
    started = time.monotonic()
    r = server.post("/v1/completions", json={"prompt": ["x"] * 4000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/completions", json={"prompt": ["x"] * 200, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and "max_prompts_per_request" in r.json()["error"]["message"]
    assert time.monotonic() - started < 5
    completes(server)


def test_a_burst_within_running_capacity_is_admitted_whole(server):
    """100 concurrent requests, room for 128 running + 8 queued: none refused."""

    async def burst():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "Go", "max_tokens": 2, "ignore_eos": True}
            return await asyncio.gather(*(client.post(server.base_url + "/v1/completions", json=body)
                                          for _ in range(100)))

    statuses = [r.status_code for r in asyncio.run(burst())]
    assert statuses.count(200) == 100, statuses


def raw_exchange(server, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send raw bytes; (everything the server sent until it closed, seconds until then)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


def test_too_many_or_too_large_headers_are_431(server):
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(10_000))
    for head in (many, b"X-Big: " + b"a" * 1_000_000 + b"\r\n"):
        try:
            received, _ = raw_exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        except ConnectionResetError:  # closed while we were still sending: refused all the same
            continue
        assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    assert server.get("/v1/models").status_code == 200


def test_slow_clients_are_cut_off(server):
    received, seconds = raw_exchange(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # head never ends
    assert received.startswith(b"HTTP/1.1 408 ") and seconds < 5
    _, seconds = raw_exchange(server, b"")  # connects, sends nothing
    assert seconds < 5
    body_never_ends = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"prompt\":")
    received, seconds = raw_exchange(server, body_never_ends)
    assert received.startswith(b"HTTP/1.1 408 ") and seconds < 5, received[:200]
    received, seconds = trickled_body(server, byte_every_s=0.5)  # never idle for 1 s: the body deadline ends it
    assert received.startswith(b"HTTP/1.1 408 ") and b"request body not received within 2.0s" in received
    assert 1.5 < seconds < 5
    completes(server)


def trickled_body(server, byte_every_s: float) -> tuple[bytes, float]:
    """A completion body sent a byte at a time; (what the server sent until it closed, seconds until then)."""
    body = b'{"prompt": "hi", "max_tokens": 1}' + b" " * 100
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(POST_HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(byte_every_s)
        received = b""
        for byte in body:
            try:
                sock.send(bytes([byte]))
                received += sock.recv(65536)  # times out while the server waits for more
                break  # it answered (or closed)
            except TimeoutError:
                continue
        sock.settimeout(10)
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("framing", [
    b"Content-Length: abc\r\n\r\n{}",
    b"Content-Length: -1\r\n\r\n{}",
    b"Content-Length: 2\r\nContent-Length: 40\r\n\r\n{}",
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",  # smuggling
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
], ids=["not-a-number", "negative", "two-lengths", "length-and-chunked", "bad-chunk-size"])
def test_malformed_framing_is_400_and_reaches_no_handler(server, framing):
    received, _ = raw_exchange(server, POST_HEAD + framing)
    assert received.startswith(b"HTTP/1.1 400 "), received[:200]
    completes(server)


def test_a_flood_of_tiny_chunks_is_cut_at_the_body_limit(server):
    rss_before = psutil.Process(server.proc.pid).memory_info().rss
    chunk = b"10\r\n" + b" " * 16 + b"\r\n"
    flood = POST_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunk * 400_000  # 6.4 MB of body, 3x the limit
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(flood + b"0\r\n\r\n")
        received = b""
        while b"}}" not in received and (chunk := sock.recv(65536)):  # the error document ends in "}}"
            received += chunk
    assert received.startswith(b"HTTP/1.1 400 ") and b"max_request_bytes" in received, received[:300]
    growth = psutil.Process(server.proc.pid).memory_info().rss - rss_before
    assert growth < 32 * 2**20, f"server grew {growth >> 20} MiB reading a refused body"
    completes(server)


def test_the_server_is_healthy_and_idle_afterwards(server):
    completes(server)
    assert server.get("/health").json()["status"] == "ok"
    assert server.metric("kiln:num_requests_running") == 0 and server.metric("kiln:num_requests_waiting") == 0
    assert server.proc.poll() is None
