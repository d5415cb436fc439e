"""Statistics of a version served by a model that batches itself (an LLM's
engine): every execution counts, streamed, failed or cancelled. Streamed and
failed calls were missing from `inference_count` / `execution_count` and had no
`kiln_inference_*` series at all."""

import asyncio

import numpy as np
import pytest
from prometheus_client import generate_latest

from kiln.serving.metrics import ServingMetrics
from kiln.serving.model import AsyncModel
from kiln.serving.repository.config import parse_config
from kiln.serving.repository.version import LoadedVersion
from kiln.serving.types import InferRequest, InferResponse
from tests.unit.serving.models import doubler_config


class SelfBatching(AsyncModel):
    async def infer(self, request):
        if request.parameters.get("fail"):
            raise RuntimeError("the engine failed")
        if request.parameters.get("hang"):
            await asyncio.Event().wait()
        return {"OUT": request.inputs["IN"] * 2}

    def stream(self, request):
        if not request.parameters.get("stream"):
            return None

        async def responses():
            for k in (1, 2):
                yield InferResponse(request.model_name, "1", {"OUT": request.inputs["IN"] * k})
        return responses()


def request(rows: int = 1, **parameters) -> InferRequest:
    return InferRequest("m", {"IN": np.ones((rows, 2), np.float32)}, parameters=parameters)


def test_every_execution_of_a_self_batching_model_counts():
    metrics = ServingMetrics()
    version = LoadedVersion(parse_config(doubler_config(), name="m"), 1, metrics, async_model=SelfBatching())

    async def main():
        await version.infer(request(rows=2))
        streamed = [r async for r in version.stream(request(stream=True))]
        with pytest.raises(RuntimeError):
            await version.infer(request(fail=True))
        hung = asyncio.ensure_future(version.infer(request(hang=True)))
        await asyncio.sleep(0.01)
        hung.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hung
        return streamed

    assert len(asyncio.run(main())) == 2
    stats = version.stats
    assert (stats.success.count, stats.fail.count) == (2, 2)
    assert (stats.execution_count, stats.inference_count) == (4, 5)
    text = generate_latest(metrics.registry).decode()
    assert 'kiln_inference_exec_count_total{model="m",version="1"} 4.0' in text
    assert 'kiln_inference_count_total{model="m",version="1"} 5.0' in text
