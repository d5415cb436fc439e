"""Routes on a live `kiln serve --model-repository`, through stock clients:
OpenAI (the `model` field names the route), KServe v2 over HTTP and gRPC.

The repository: `tiny` (an LLM, versions 1 and 2: one engine each), `m`
(a python model whose versions answer their number; version 3 fails) and
routes.yaml with three routes."""

import math
import shutil
import threading
import time

import httpx
import numpy as np
import pytest
import yaml

from tests.integration.openai.live import free_port, kiln_server
from tests.unit.dataplane.routing.models import VERSIONED_PY, versioned_config
from tests.unit.serving.models import write_model

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")

ROUTES = {
    "chat": {"targets": {"tiny@1": 1, "tiny@2": 1}},
    "solo": {"targets": {"tiny@1": 1}, "shadow": {"tiny@2": 1.0}},
    "score": {"targets": {"m@1": 80, "m@2": 20}, "shadow": {"m@3": 1.0}},
}
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("routes") / "repo"
    for version in (1, 2):
        shutil.copytree(tiny_llama_dir, root / "tiny" / str(version) / "weights")
    (root / "tiny" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "llm",
        "version_policy": {"all": True},
        "parameters": {"model": "weights", "kv_cache_memory_gib": 0.02, "max_model_len": 256},
    }))
    write_model(root, "m", versioned_config(fail_version=3), {v: {"model.py": VERSIONED_PY} for v in (1, 2, 3)})
    (root / "routes.yaml").write_text(yaml.safe_dump({"routes": ROUTES}))
    return root


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    grpc_port = free_port()
    args = ("--model-repository", str(repository), "--grpc-port", str(grpc_port),
            "--price-per-hour", "2.0", "--cost-window-s", "60")
    with kiln_server(None, *args, tmp_dir=tmp_path_factory.mktemp("log")) as s:
        s.grpc_port = grpc_port
        yield s


def metric(server, name: str, **labels) -> float:
    try:
        return server.metric(name, **labels)
    except KeyError:
        return 0.0


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def score_input(module):
    tensor = module.InferInput("IN", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), np.float32))
    return [tensor]


def test_openai_route_says_which_target_served_and_keeps_its_name_in_the_body(server):
    client = server.openai()
    targets = []
    for _ in range(20):
        raw = client.completions.with_raw_response.create(model="chat", prompt="Hello", max_tokens=3, temperature=0)
        assert raw.parse().model == "chat"
        targets.append(raw.headers["x-kiln-route-target"])
    assert set(targets) == {"tiny@1", "tiny@2"}
    alice = {client.chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, max_tokens=2, user="alice").headers["x-kiln-route-target"] for _ in range(6)}
    assert len(alice) == 1  # the `user` field keeps a client on one target
    reported = client.chat.completions.with_raw_response.create(
        model="chat", messages=MESSAGES, max_tokens=2, user="alice", extra_headers={"x-kiln-report-target": "1"})
    assert reported.parse().model == reported.headers["x-kiln-route-target"] == alice.pop()
    with client.chat.completions.with_streaming_response.create(
        model="chat", messages=MESSAGES, max_tokens=3, stream=True, extra_headers={"x-kiln-route-key": "k1"}
    ) as streamed:
        target = streamed.headers["x-kiln-route-target"]
        assert any("chat.completion.chunk" in line for line in streamed.iter_lines())
    again = client.completions.with_raw_response.create(
        model="chat", prompt="x", max_tokens=1, extra_headers={"x-kiln-route-key": "k1"})
    assert again.headers["x-kiln-route-target"] == target
    assert {"chat", "solo", "tiny"} <= {m.id for m in client.models.list()}


def test_llm_shadow_runs_on_its_target_and_never_answers(server):
    before = metric(server, "kiln:route_shadow_requests_total", route="solo", target="tiny@2")
    raw = server.openai().completions.with_raw_response.create(model="solo", prompt="Hello", max_tokens=4)
    assert raw.headers["x-kiln-route-target"] == "tiny@1" and raw.parse().model == "solo"
    deadline = time.monotonic() + 30
    while metric(server, "kiln:route_shadow_requests_total", route="solo", target="tiny@2") < before + 1:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert metric(server, "kiln:route_shadow_errors_total", route="solo", target="tiny@2") == 0


def test_kserve_http_split_matches_the_weights_and_a_failing_shadow_is_invisible(server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    n = 300
    versions = []
    for _ in range(n):
        result = client.infer("score", score_input(httpclient))  # raises on any error the caller would see
        version = int(result.as_numpy("OUT")[0, 0])
        assert result.get_response()["parameters"]["kiln_route_target"] == f"m@{version}"
        versions.append(version)
    assert within_binomial(versions.count(2), n, 0.2) and set(versions) == {1, 2}
    keyed = {int(client.infer("score", score_input(httpclient), headers={"x-kiln-route-key": "bob"})
                 .as_numpy("OUT")[0, 0]) for _ in range(10)}
    assert len(keyed) == 1
    r = httpx.post(f"{server.base_url}/v2/models/score/infer",
                   json={"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]})
    assert r.headers["x-kiln-route-target"] == r.json()["parameters"]["kiln_route_target"]
    deadline = time.monotonic() + 10
    while metric(server, "kiln:route_shadow_requests_total", route="score", target="m@3") < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shadow_errors = metric(server, "kiln:route_shadow_errors_total", route="score", target="m@3")
    assert shadow_errors == metric(server, "kiln:route_shadow_requests_total", route="score", target="m@3") >= n
    assert metric(server, "kiln:route_errors_total", route="score", target="m@1") == 0


def test_kserve_grpc_names_the_target_in_parameters_and_trailing_metadata(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    seen = set()
    for _ in range(8):
        result = client.infer("score", score_input(grpcclient), headers={"x-kiln-route-key": "carol"})
        target = result.get_response().parameters["kiln_route_target"].string_param
        assert target == f"m@{int(result.as_numpy('OUT')[0, 0])}" and result.get_response().model_name == "score"
        seen.add(target)
    assert len(seen) == 1

    import grpc

    from kiln.frontends.kserve.grpc.stubs import load_stubs

    pb2, pb2_grpc = load_stubs()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        request = pb2.ModelInferRequest(model_name="score")
        request.inputs.add(name="IN", datatype="FP32", shape=[1, 2]).contents.fp32_contents.extend([1.0, 2.0])
        _, call = pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer.with_call(
            request, metadata=[("x-kiln-route-key", "carol")])
        target = seen.pop()
        assert dict(call.trailing_metadata())["x-kiln-route-target"] == target
        bad = pb2.ModelInferRequest(model_name="score")  # an error answer names its target too
        bad.inputs.add(name="NOPE", datatype="FP32", shape=[1, 1]).contents.fp32_contents.append(1.0)
        with pytest.raises(grpc.RpcError) as failed:
            pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(bad, metadata=[("x-kiln-route-key", "carol")])
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(failed.value.trailing_metadata())["x-kiln-route-target"] == target


def test_route_cost_and_utilisation_metrics(server):
    assert metric(server, "kiln:route_requests_total", route="chat", target="tiny@1") > 0
    assert metric(server, "kiln:route_time_to_first_token_seconds_count", route="chat", target="tiny@2") > 0
    assert metric(server, "kiln:route_weight", route="score", target="m@1") == 80
    for version in ("1", "2"):
        assert metric(server, "kiln:model_memory_bytes", model="tiny", version=version, kind="weights") > 0
        assert metric(server, "kiln:model_memory_bytes", model="tiny", version=version, kind="kv_cache") > 0
    deadline = time.monotonic() + 10  # the cost window is sampled every second
    while metric(server, "kiln:cost_per_1m_output_tokens_usd", model="tiny", version="1") == 0:
        assert time.monotonic() < deadline, server.get("/metrics").text
        time.sleep(0.2)
    assert metric(server, "kiln:cost_per_1k_requests_usd", model="m", version="1") > 0
    assert metric(server, "kiln:route_cost_per_1k_requests_usd", route="chat", target="tiny@2") > 0
    assert metric(server, "kiln:server_price_per_hour_usd") == 2.0
    assert 0 < metric(server, "kiln:process_cpu_utilisation", model_name="tiny", process="engine") <= 1


def test_weight_changes_under_load_lose_no_request(server):
    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def kserve_client(i: int) -> None:
        body = {"inputs": [{"name": "IN", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        with httpx.Client(timeout=30) as http:
            for j in range(60):
                r = http.post(f"{server.base_url}/v2/models/score/infer", json=body,
                              headers={"x-kiln-route-key": f"{i}-{j}"})
                if r.status_code != 200:
                    failures.append(r.text)
                answered[0] += 1

    def openai_client() -> None:
        client = server.openai()
        for _ in range(8):
            try:
                client.completions.create(model="chat", prompt="Hello", max_tokens=4)
                answered[0] += 1
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                failures.append(repr(exc))

    def operator() -> None:
        weights = [({"m@1": 0, "m@2": 1}, {"tiny@1": 0, "tiny@2": 1}),
                   ({"m@1": 1, "m@2": 0}, {"tiny@1": 1, "tiny@2": 0})]
        i = 0
        while not stop.is_set():
            score, chat = weights[i % 2]
            for route, patch in (("score", score), ("chat", chat)):
                r = httpx.patch(f"{server.base_url}/admin/routes/{route}", json={"weights": patch})
                assert r.status_code == 200, r.text
            i += 1
            time.sleep(0.02)

    clients = [threading.Thread(target=kserve_client, args=(i,)) for i in range(4)]
    clients.append(threading.Thread(target=openai_client))
    changer = threading.Thread(target=operator)
    changer.start()
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    stop.set()
    changer.join()
    assert failures == [] and answered[0] == 4 * 60 + 8
    assert metric(server, "kiln:route_weight_changes_total", route="score", source="admin") >= 2
