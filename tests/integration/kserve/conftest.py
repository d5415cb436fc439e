import pytest

from tests.integration.kserve.live import live_server
from tests.unit.serving.models import DOUBLER_PY, basic_repository, doubler_config, write_model

MAX_BODY = 1 << 20


def serving_repository(root):
    repo = basic_repository(root / "repo")
    # A slow doubler for queue/timeout checks: one instance, queue of 1.
    write_model(repo, "slow", doubler_config(
        max_batch_size=1, parameters={"delay_ms": 400},
        dynamic_batching={"max_queue_delay_ms": 0, "max_queue_size": 1}), {1: {"model.py": DOUBLER_PY}})
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = serving_repository(tmp_path_factory.mktemp("kserve"))
    with live_server(repo, "--max-tensor-request-bytes", str(MAX_BODY), "--model-control", "explicit") as live:
        yield live
