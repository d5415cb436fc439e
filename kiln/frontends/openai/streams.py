"""Running the engine requests behind one API request.

One API request is a group of engine requests (prompts x n choices). The
group is submitted all or nothing; its streams are merged into one, in
arrival order; and closing the merge (done, client gone, error) aborts every
request of the group that has not finished.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import NamedTuple, TypeVar

from fastapi import Request

from kiln.frontends.openai.common import Usage
from kiln.llm.engine.async_llm import AsyncLLM, RequestStream
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams

T = TypeVar("T")


class Submitted(NamedTuple):
    """The engine requests of one API request, as submitted."""

    group_id: str
    streams: list[RequestStream]
    usage: Usage
    engine: AsyncLLM


async def run_to_end(submitted: Submitted) -> None:
    """Consume every stream, discarding the outputs (a shadow copy)."""
    try:
        await collect_finals(submitted.streams)
    finally:
        close_all(submitted.streams)


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def submit_group(
    engine: AsyncLLM, group_id: str, prompts: list[list[int]], params: list[list[SamplingParams]], priority: int
) -> list[RequestStream]:
    """Choice index `p * n + i` is prompt p, sample i. On any error, nothing stays submitted."""
    streams: list[RequestStream] = []
    try:
        for p, ids in enumerate(prompts):
            for choice_params in params[p]:
                streams.append(engine.add_request(f"{group_id}-{len(streams)}", ids, choice_params, priority))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


def close_all(streams: list[RequestStream]) -> None:
    """Abort whatever of the group has not finished (idempotent)."""
    for s in streams:
        s.close()


async def merge(streams: list[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(choice index, output) from all streams as they come; the first error is raised."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0].__aiter__()) as it:
            async for out in it:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()  # a cancelled pump's stream aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client leaves first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves: take the work down too
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


async def collect_finals(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream, by choice index."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async with contextlib.aclosing(merge(streams)) as merged:
        async for index, out in merged:
            finals[index] = out
    return finals  # type: ignore[return-value]
