"""API key checks, then SIGTERM: in-flight requests finish, new ones are
refused, the server exits 0 and leaves no engine process behind."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.integration.openai.live import kiln_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    flags = ["--num-blocks", "64", "--served-model-name", "tiny", "--shutdown-timeout", "30"]
    with kiln_server(tiny_llama_dir, *flags, api_key=KEY, tmp_dir=tmp_path_factory.mktemp("lifecycle")) as s:
        yield s


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}]
)
def test_missing_or_wrong_key_is_401(server, headers):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base_url + "/v1/models", headers=headers).status_code == 401


def test_open_endpoints_need_no_key(server):
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(server.base_url + path).status_code == 200, path


def test_right_key_works_with_the_openai_client(server):
    out = server.openai().completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_sigterm_drains_then_exits_cleanly(server):
    engine = psutil.Process(server.engine_pid())
    events: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": "A long answer", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", server.base_url + "/v1/completions", json=body, headers=server.headers(), timeout=60
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_chunk.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_chunk.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # the listening socket is closed: no new requests
        httpx.get(server.base_url + "/health", timeout=5)
    reader.join(60)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "length"  # the in-flight request finished in full
    assert server.proc.wait(timeout=30) == 0
    engine.wait(timeout=10)
    assert not engine.is_running()
