"""`kiln bench infer`: bad options and server failures are one-line errors, not tracebacks."""

from __future__ import annotations

import functools
import socket

import httpx
import pytest

from kiln.cli.main import main as kiln_main

METADATA = {"name": "m", "platform": "python", "inputs": [{"name": "IN", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "OUT", "datatype": "FP32", "shape": [-1, 2]}]}


def _bench(*args: str) -> list[str]:
    return ["bench", "infer", "--model", "m", "--duration", "0.05", "--concurrency", "1", *args]


def _free_port() -> int:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server(monkeypatch):
    """Route the bench's httpx client to `answers[(method, path)] -> (status, json)`."""
    answers = {("GET", "/v2/models/m"): (200, METADATA), ("POST", "/v2/models/m/infer"): (200, {})}

    def handle(request: httpx.Request) -> httpx.Response:
        status, body = answers.get((request.method, request.url.path), (404, {"error": "no such path"}))
        return httpx.Response(status, json=body)

    client = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(handle))
    monkeypatch.setattr(httpx, "AsyncClient", client)
    return answers


@pytest.mark.parametrize("option, value", [
    ("--concurrency", "a,b"), ("--concurrency", "0"), ("--concurrency", "-1"), ("--concurrency", ","),
    ("--duration", "-1"), ("--duration", "0"), ("--duration", "nan"), ("--duration", "inf"),
    ("--batch-size", "0"), ("--batch-size", "-3"), ("--batch-size", "x"), ("--dim", "0"),
])
def test_bad_option_values_are_usage_errors(option, value, capsys):
    with pytest.raises(SystemExit) as info:
        kiln_main([*_bench(), option, value])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"error: argument {option}:" in err and "Traceback" not in err


def test_an_unreachable_server_is_one_line(capsys):
    port = _free_port()
    assert kiln_main(_bench("--url", f"127.0.0.1:{port}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot reach the server at http://127.0.0.1:{port}" in err


@pytest.mark.parametrize(("url", "fragment"), [
    ("127.0.0.1:99999", "--url '127.0.0.1:99999': the port must be in [1, 65535]"),  # a traceback
    ("", "--url must not be empty"),  # silently the default server
])
def test_an_impossible_url_is_one_line(url, fragment, capsys):
    assert kiln_main(_bench("--url", url)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err


def test_an_unreachable_grpc_server_is_one_line(capsys):
    port = _free_port()
    assert kiln_main(_bench("--protocol", "grpc", "--url", f"127.0.0.1:{port}")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"gRPC UNAVAILABLE from 127.0.0.1:{port}" in err


def test_a_refused_warmup_names_the_url_status_and_message(server, capsys):
    server[("POST", "/v2/models/m/infer")] = (400, {"error": "batch size 100 exceeds max_batch_size 8"})
    assert kiln_main(_bench("--batch-size", "100", "--url", "127.0.0.1:9")) == 2
    err = capsys.readouterr().err
    assert err == ("kiln: error: HTTP 400 from http://127.0.0.1:9/v2/models/m/infer: "
                   "batch size 100 exceeds max_batch_size 8\n")


def test_an_unknown_model_names_the_url(server, capsys):
    server[("GET", "/v2/models/m")] = (404, {"error": "model 'm' is not in the model repository"})
    assert kiln_main(_bench("--url", "127.0.0.1:9")) == 2
    assert "HTTP 404 from http://127.0.0.1:9/v2/models/m: model 'm'" in capsys.readouterr().err


def test_a_good_sweep_reports_each_level(server, capsys):
    assert kiln_main(_bench("--concurrency", "1,2", "--url", "127.0.0.1:9")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "m over http at 127.0.0.1:9" and len(lines) == 4
