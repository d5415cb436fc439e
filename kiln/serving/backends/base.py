"""`TensorModel`: the shared execute() of framework backends.

Subclasses implement `run(inputs) -> outputs` on one (possibly batched) set of
arrays. execute() concatenates the requests, runs once and splits the rows
back. If the batched run raises, each request is run alone so that a failing
request fails alone (the others still get their answers).
"""
from __future__ import annotations

import time

import numpy as np

from kiln.serving.batching.concat import Batch, concat_inputs, split_outputs
from kiln.serving.model import LoadContext, Model, Result, Timings
from kiln.serving.repository.config import RepositoryModelConfig
from kiln.serving.types import InferRequest


class TensorModel(Model):
    config: RepositoryModelConfig

    def load(self, context: LoadContext) -> None:
        self.config = context.config

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def execute(self, requests: list[InferRequest]) -> list[Result]:
        self.timings = Timings()
        try:
            return self._execute_batched(requests)
        except Exception as exc:  # noqa: BLE001 - isolate per request below
            if len(requests) == 1:
                return [exc]
        return [self._execute_one(r) for r in requests]

    def _execute_one(self, request: InferRequest) -> Result:
        try:
            return self._execute_batched([request])[0]
        except Exception as exc:  # noqa: BLE001 - this request's own error
            return exc

    def _execute_batched(self, requests: list[InferRequest]) -> list[Result]:
        t0 = time.perf_counter_ns()
        batch = self._concat(requests)
        t1 = time.perf_counter_ns()
        outputs = self.run(batch.inputs)
        t2 = time.perf_counter_ns()
        if self.config.max_batch_size == 0:
            results: list[Result] = [outputs]
        else:
            trim = self.config.dynamic_batching.trim_outputs if self.config.dynamic_batching else ()
            results = list(split_outputs(outputs, batch, trim))
        t3 = time.perf_counter_ns()
        timings = self.timings or Timings()
        timings.compute_input_ns += t1 - t0
        timings.compute_infer_ns += t2 - t1
        timings.compute_output_ns += t3 - t2
        self.timings = timings
        return results

    def _concat(self, requests: list[InferRequest]) -> Batch:
        if self.config.max_batch_size == 0:
            if len(requests) != 1:
                raise ValueError("a model without batching runs one request at a time")
            return Batch(dict(requests[0].inputs), [1], [()])
        batching = self.config.dynamic_batching
        pad = batching.pad_value if batching and batching.variable_shapes == "pad" else None
        return concat_inputs(requests, pad)
