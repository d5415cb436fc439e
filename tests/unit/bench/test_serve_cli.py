"""`kiln bench serve` misuse: one `kiln: error:` line and exit 2 before any request."""
from __future__ import annotations

import socket

import pytest

from kiln.cli.main import main as kiln_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench(*extra: str) -> list[str]:
    return ["bench", "serve", "--model", "m", "--base-url", f"http://127.0.0.1:{_free_port()}", *extra]


@pytest.mark.parametrize(("options", "fragment"), [
    (["--request-rate", "0"], "--request-rate must be positive"),  # ZeroDivisionError
    (["--request-rate", "nan"], "--request-rate must be positive"),
    (["--max-concurrency", "-1"], "--max-concurrency must be at least 1"),
    (["--range-ratio", "nan"], "--range-ratio must be in [0, 1)"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),  # accepted silently
    (["--output-len", "-3"], "--output-len must be at least 1"),  # sent as 1 token
    (["--goodput", "ttft:abc"], "--goodput: "),
    (["--goodput", "foo"], "--goodput: bad SLO 'foo'"),
    (["--goodput", "ttft:-5"], "--goodput: SLOs must be positive milliseconds"),
    (["--dataset", "jsonl"], "--dataset jsonl needs --dataset-path"),  # exit 1, no prefix
    (["--dataset", "jsonl", "--dataset-path", "/nonexistent.jsonl"], "is not a file"),
    (["--result-json", "/nonexistent/dir/x.json"], "its directory does not exist"),  # after the whole run
    ([], "cannot reach http://127.0.0.1:"),  # every prompt tried, then a table of zeros
])
def test_bad_options_fail_before_the_first_request(options, fragment, capsys):
    assert kiln_main(_bench(*options)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and fragment in err and err.count("\n") == 1
