"""One live server for the fuzz suites: the tiny Llama on the command line
(OpenAI routes, and KServe as `tiny`), plus a repository with a numeric and a
text python model. Work per request is bounded by the flags (max_tokens 8,
n 4, 8 generations per request), so a thousand random requests take a minute.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration.openai.live import kiln_server
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model

ECHO_PY = "class Echo:\n    def execute(self, requests):\n        return [{'T': r.inputs['T']} for r in requests]\n"
FLAGS = ("--num-blocks", "256", "--served-model-name", "tiny", "--max-tokens-limit", "8", "--max-n", "4",
         "--max-prompts-per-request", "8", "--max-queued-requests", "64", "--max-request-bytes", "200000",
         "--max-tensor-request-bytes", "200000", "--timeout-idle-s", "5")


@pytest.fixture(scope="package")
def fuzz_server(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    repo = root / "repo"
    write_model(repo, "double", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(repo, "echo", {"backend": "python", "max_batch_size": 0,
                               "inputs": [{"name": "T", "datatype": "BYTES", "dims": [-1]}],
                               "outputs": [{"name": "T", "datatype": "BYTES", "dims": [-1]}]},
                {1: {"model.py": ECHO_PY}})
    with kiln_server(tiny_llama_dir, *FLAGS, "--model-repository", str(repo), "--grpc-port", "-1",
                     tmp_dir=root) as server:
        server.first_engine_pid = server.engine_pid()
        with httpx.Client() as client:  # one client: a fresh one per request costs ~0.1 s of TLS setup
            server.client = client
            yield server
