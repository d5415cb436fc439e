"""Merging the streams of one API request; closing the merge aborts the rest."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kiln.frontends.openai.streams import close_all, collect_finals, merge
from kiln.llm.engine.async_llm import RequestStream
from kiln.llm.outputs import CompletionOutput, RequestOutput


def output(rid: str, text: str, finished: bool) -> RequestOutput:
    return RequestOutput(
        rid,
        None,
        [1],
        [CompletionOutput(0, text, [1], "length" if finished else None)],
        finished=finished,
        delta_text=text,
        delta_token_ids=[1],
    )


def make_streams(n: int, aborted: list[str]) -> list[RequestStream]:
    return [RequestStream(f"r{i}", aborted.append) for i in range(n)]


def test_collect_finals_orders_by_choice():
    async def run():
        aborted: list[str] = []
        streams = make_streams(3, aborted)
        for i in (2, 0, 1):
            streams[i].put(output(f"r{i}", "a", False))
            streams[i].put(output(f"r{i}", f"end{i}", True))
        finals = await collect_finals(streams)
        return finals, aborted

    finals, aborted = asyncio.run(run())
    assert [f.outputs[0].text for f in finals] == ["end0", "end1", "end2"]
    assert aborted == []


def test_leaving_the_merge_early_aborts_unfinished_streams():
    async def run():
        aborted: list[str] = []
        streams = make_streams(3, aborted)
        streams[0].put(output("r0", "done", True))
        streams[1].put(output("r1", "partial", False))
        seen = []
        async with contextlib.aclosing(merge(streams)) as merged:
            async for index, _out in merged:
                seen.append(index)
                if len(seen) == 2:
                    break
        return sorted(aborted), seen

    aborted, seen = asyncio.run(run())
    assert aborted == ["r1", "r2"] and sorted(seen) == [0, 1]


def test_an_error_in_one_stream_ends_the_merge():
    async def run():
        aborted: list[str] = []
        streams = make_streams(2, aborted)
        streams[1].put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError):
            await collect_finals(streams)
        return aborted

    assert asyncio.run(run()) == ["r0"]


def test_close_all_is_idempotent_and_skips_finished():
    aborted: list[str] = []
    streams = make_streams(2, aborted)
    streams[0].finished = True
    close_all(streams)
    close_all(streams)
    assert aborted == ["r1"]
