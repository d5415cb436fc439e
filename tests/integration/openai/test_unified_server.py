"""`kiln serve --model-repository`: one server, OpenAI + KServe v2 (HTTP and
gRPC) routes; the repository's `llm` model runs on one engine for both, and
loading a new version swaps the engine both serve."""
import re
import shutil
import threading
import time

import numpy as np
import pytest
import yaml

from tests.integration.openai.live import free_port, kiln_server

PYTHON_MODEL = '''
import numpy as np
from kiln.serving.model import Model

class Double(Model):
    def execute(self, requests):
        return [{"OUT": r.inputs["IN"] * 2} for r in requests]
'''


@pytest.fixture(scope="module")
def repository(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("repo")
    llm = root / "tiny" / "1"
    llm.mkdir(parents=True)
    shutil.copytree(tiny_llama_dir, llm / "weights")
    (root / "tiny" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "llm",
        "max_batch_size": 8,
        "inputs": [{"name": "text_input", "datatype": "BYTES", "dims": [1]},
                   {"name": "max_tokens", "datatype": "INT32", "dims": [1], "optional": True}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "dims": [1]}],
        "parameters": {"model": "weights", "kv_cache_memory_gib": 0.02, "max_model_len": 256},
    }))
    double = root / "double" / "1"
    double.mkdir(parents=True)
    (double / "model.py").write_text(PYTHON_MODEL)
    (root / "double" / "config.yaml").write_text(yaml.safe_dump({
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "IN", "datatype": "FP32", "dims": [3]}],
        "outputs": [{"name": "OUT", "datatype": "FP32", "dims": [3]}],
    }))
    return root


@pytest.fixture(scope="module")
def server(repository, tmp_path_factory):
    grpc_port = free_port()
    with kiln_server(None, "--model-repository", str(repository), "--grpc-port", str(grpc_port),
                     "--model-control", "explicit", tmp_dir=tmp_path_factory.mktemp("log")) as s:
        s.grpc_port = grpc_port
        yield s


def test_llm_model_on_openai_and_kserve_gives_the_same_text(server):
    completion = server.openai().completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Hello there"]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [6]}]}
    r = server.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [completion.choices[0].text]


def test_llm_model_structured_output_parameters(server):
    prompt = {"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Code:"]}
    limit = {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [12]}
    body = {"inputs": [prompt, limit], "parameters": {"guided_regex": "[a-c]{3}-[0-9]"}}
    r = server.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 200, r.text
    assert re.fullmatch("[a-c]{3}-[0-9]", r.json()["outputs"][0]["data"][0])
    bad = server.post("/v2/models/tiny/infer", json={**body, "parameters": {"guided_json": '{"type": "nonsense"}'}})
    assert bad.status_code == 400 and "guided_json" in bad.json()["error"]
    # A 210,000-character regex compiled for 222 s here (the OpenAI routes cap it at 65,536).
    huge = server.post("/v2/models/tiny/infer", json={**body, "parameters": {"guided_regex": "a" * 70_000}})
    assert huge.status_code == 400 and "guided_regex has 70000 characters; at most 65536" in huge.json()["error"]


def test_python_model_over_grpc_and_health(server):
    import tritonclient.grpc as grpcclient

    assert server.get("/health").json()["models"] == {"tiny": "ready", "double": "ready"}
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    assert client.is_server_ready() and client.is_model_ready("double")
    tensor = grpcclient.InferInput("IN", [1, 3], "FP32")
    tensor.set_data_from_numpy(np.array([[1, 2, 3]], dtype=np.float32))
    out = client.infer("double", [tensor]).as_numpy("OUT")
    assert out.tolist() == [[2, 4, 6]]


def test_bad_llm_input_is_a_400_and_the_server_keeps_serving(server):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [""]}]}
    r = server.post("/v2/models/tiny/infer", json=body)
    assert r.status_code == 400 and "empty" in r.json()["error"]
    assert server.get("/v2/health/ready").status_code == 200


def test_autoscaling_metrics_cover_both_models(server):
    """Queue, oldest wait, in-flight and the desired-replicas hint, per model, LLM and repository alike."""
    client = server.openai()
    for _ in range(3):
        client.completions.create(model="tiny", prompt="Hello there", max_tokens=4, temperature=0)
    time.sleep(2.5)  # the data plane samples every model once a second
    for model in ("tiny", "double"):
        assert server.metric("kiln:queue_length", model_name=model) == 0
        assert server.metric("kiln:requests_in_flight", model_name=model) == 0
        assert server.metric("kiln:queue_oldest_wait_seconds", model_name=model) == 0
    # Three short requests just arrived and finished: a small demand, well under one replica (requests
    # shorter than the 1 s sampling period may all fall between samples of the requests in service).
    assert server.metric("kiln:autoscale_arrival_rate", model_name="tiny") > 0
    assert 0 <= server.metric("kiln:desired_replicas", model_name="tiny") < 1


def test_repo_validate_command(repository, capsys):
    from kiln.cli.main import main

    assert main(["repo", "validate", str(repository)]) == 0
    assert "all models valid" in capsys.readouterr().out


def test_llm_tokens_stream_over_grpc_model_stream_infer(server):
    import queue

    import tritonclient.grpc as grpcclient

    full = server.openai().completions.create(model="tiny", prompt="Hello there", max_tokens=8, temperature=0)
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"Hello there"]], dtype=object))
    limit = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    limit.set_data_from_numpy(np.array([[8]], dtype=np.int32))
    client.async_stream_infer("tiny", [text, limit], parameters={"stream": True})
    pieces = []
    while True:
        result, error = responses.get(timeout=60)
        assert error is None, error
        pieces.append(result.as_numpy("text_output").reshape(-1)[0].decode())
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    assert len(pieces) > 1  # streamed, not one blob
    assert "".join(pieces) == full.choices[0].text


def test_loading_a_new_llm_version_swaps_the_engine_openai_serves(server, repository, tiny_llama3_dir):
    """Version 2 (other weights) replaces version 1: a stream running across
    the swap finishes on the old engine, then the old engine process is gone
    and both transports answer from the new one."""
    client = server.openai()
    before = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    old_engine = server.engine_pid()
    stream = client.completions.create(model="tiny", prompt="Once", max_tokens=120, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # the request is running on version 1's engine
    chunks: list = [first]
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    shutil.copytree(tiny_llama3_dir, repository / "tiny" / "2" / "weights")
    r = server.post("/v2/repository/models/tiny/load", json={})  # returns once version 1 is unloaded
    reader.join(timeout=120)
    assert r.status_code == 200, r.text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 120
    after = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0)
    assert after.choices[0].text != before.choices[0].text
    assert server.engine_pid() != old_engine
    assert [m["version"] for m in server.post("/v2/repository/index", json={}).json() if m["name"] == "tiny"] == ["2"]
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": ["Hello there"]},
                       {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [6]}]}
    assert server.post("/v2/models/tiny/infer", json=body).json()["outputs"][0]["data"] == [after.choices[0].text]
