"""A live server with broken models: the rest serve; readiness tells."""
import numpy as np
import pytest

from tests.integration.kserve.live import live_server
from tests.unit.serving.models import DOUBLER_PY, doubler_config, write_model

httpclient = pytest.importorskip("tritonclient.http")


@pytest.fixture(scope="module")
def broken_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("broken") / "repo"
    write_model(repo, "doubler", doubler_config(), {1: {"model.py": DOUBLER_PY}})
    write_model(repo, "crashes_on_load", doubler_config(parameters={"fail_load": True}), {1: {"model.py": DOUBLER_PY}})
    write_model(repo, "bad_config", {"backend": "python", "max_batch_size": -1}, {1: {"model.py": DOUBLER_PY}})
    (repo / "not..valid").mkdir()
    with live_server(repo) as live:
        yield live


def test_good_model_serves_while_bad_ones_are_reported(broken_server):
    client = httpclient.InferenceServerClient(broken_server.http_url)
    assert client.is_server_live()
    assert not client.is_server_ready()  # strict readiness: not every model loaded
    x = httpclient.InferInput("IN", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), np.float32))
    assert client.infer("doubler", [x]).as_numpy("OUT").tolist() == [[2.0, 2.0]]
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["crashes_on_load"]["state"] == "UNAVAILABLE" and "asked to fail" in index["crashes_on_load"]["reason"]
    assert index["bad_config"]["state"] == "UNAVAILABLE" and "max_batch_size" in index["bad_config"]["reason"]
    response = broken_server.post("/v2/models/crashes_on_load/infer", content=b'{"inputs": []}')
    assert response.status_code == 503 and "not ready" in response.json()["error"]
    assert "crashes_on_load" in broken_server.log()


def test_metrics_endpoint(broken_server):
    text = broken_server.get("/metrics").text
    assert 'kiln_inference_request_success_total{model="doubler",version="1"}' in text
    assert "kiln_inference_batch_size_bucket" in text and "kiln_model_load_duration_secs" in text
