"""schemathesis against the running app's own OpenAPI document (/openapi.json,
which declares every JSON body from the request models): requests generated
from it, within the schema and beyond it, on every route, get no 5xx and the
server serves normally after each (issue 17).

Operations are driven through schemathesis' strategies with Hypothesis
directly (its pytest plugin does not run on pytest 9). The route-admin API
(/admin/routes) is left out: it changes routing for the other suites sharing
this server."""

from __future__ import annotations

import os

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.integration.fuzz.checks import TIMEOUT_S, still_serving

EXAMPLES = int(os.environ.get("KILN_SCHEMATHESIS_EXAMPLES", "10"))
# Probes answer 503 for "not ready" by design (a model name nobody serves is not ready).
PROBES = ("/health", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}/ready",
          "/v2/models/{name}/versions/{version}/ready")


@pytest.fixture(scope="package")
def app_schema(fuzz_server):
    document = fuzz_server.client.get(fuzz_server.base_url + "/openapi.json").json()
    return schemathesis.openapi.from_dict(document).exclude(path_regex="^/admin/")


def test_the_document_declares_every_json_body(app_schema):
    posts = {op.ok().path for op in app_schema.get_all_operations() if op.ok().method.upper() == "POST"}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
            "/v2/models/{name}/infer", "/v2/repository/index"} <= posts
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = app_schema[path]["POST"].definition.raw["requestBody"]
        assert "max_tokens" in body["content"]["application/json"]["schema"]["properties"]


def exercise(operation, mode: GenerationMode, server, session: requests.Session) -> None:
    """EXAMPLES generated requests of one operation, each answered without a 5xx."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("KILN_FUZZ_RANDOM"),
              database=None, suppress_health_check=list(HealthCheck))
    def run(case):
        response = case.call(base_url=server.base_url, session=session, timeout=TIMEOUT_S)
        allowed = {503} if operation.path in PROBES else set()
        assert response.status_code < 500 or response.status_code in allowed, (
            operation.label, case.path_parameters, case.query, case.body, response.text[:300])
        if operation.method.upper() == "POST":
            still_serving(server)

    run()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_no_route_answers_5xx(app_schema, fuzz_server, mode):
    with requests.Session() as session:
        for result in app_schema.get_all_operations():
            operation = result.ok()
            if mode is GenerationMode.NEGATIVE and not has_input(operation):
                continue  # nothing NEGATIVE mode can break: free-form string path parameters at most
            exercise(operation, mode, fuzz_server, session)


def has_input(operation) -> bool:
    """A body or a query parameter (path parameters here are free-form strings)."""
    return bool(operation.get_request_payload_content_types()) or any(
        p.location != "path" for p in operation.iter_parameters())
