"""Runs one ensemble request: each step starts as soon as its inputs exist.

`infer` is the data plane's internal call into a member model (through its
own batcher, so member models batch across ensemble requests). The first
failing step fails the request and cancels the steps still running.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import numpy as np

from kiln.serving.repository.config import EnsembleStep, RepositoryModelConfig
from kiln.serving.types import InferRequest

MemberInfer = Callable[[InferRequest], Awaitable[dict[str, np.ndarray]]]


class EnsembleRunner:
    def __init__(self, config: RepositoryModelConfig, depends: list[list[int]], infer: MemberInfer):
        self.config = config
        self.depends = depends
        self.infer = infer
        self.shared = shared_tensors(config)

    async def run(self, request: InferRequest) -> dict[str, np.ndarray]:
        tensors: dict[str, np.ndarray] = dict(request.inputs)
        done = [asyncio.Event() for _ in self.config.steps]

        async def step_task(index: int, step: EnsembleStep) -> None:
            for dep in self.depends[index]:
                await done[dep].wait()
            # A model may write into its inputs (`x *= 2`, torch's `mul_`): a tensor
            # another step or the response also reads goes to it as its own copy.
            inputs = {name: tensors[tensor].copy() if tensor in self.shared else tensors[tensor]
                      for name, tensor in step.input_map.items() if tensor in tensors}
            member = InferRequest(
                model_name=step.model,
                model_version=str(step.version) if step.version else "",
                id=request.id,
                inputs=inputs,
                parameters={k: v for k, v in request.parameters.items() if k in ("timeout", "priority")},
            )
            outputs = await self.infer(member)
            for model_output, tensor in step.output_map.items():
                tensors[tensor] = outputs[model_output]
            done[index].set()

        tasks = [asyncio.ensure_future(step_task(i, s)) for i, s in enumerate(self.config.steps)]
        try:
            await _gather_or_fail(tasks)
        finally:
            for task in tasks:
                task.cancel()
        return {spec.name: tensors[spec.name] for spec in self.config.outputs}


def shared_tensors(config: RepositoryModelConfig) -> frozenset[str]:
    """Tensors read more than once: by two steps, or by a step and the response."""
    readers: dict[str, int] = {}
    for tensor in [t for step in config.steps for t in step.input_map.values()] + [o.name for o in config.outputs]:
        readers[tensor] = readers.get(tensor, 0) + 1
    return frozenset(tensor for tensor, count in readers.items() if count > 1)


async def _gather_or_fail(tasks: list[asyncio.Task]) -> None:
    """Wait for all tasks; raise the first error as soon as it happens."""
    pending = set(tasks)
    while pending:
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        for task in finished:
            error = task.exception()
            if error is not None:
                raise error
