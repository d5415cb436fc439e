"""A KServe HTTP client that hangs up: its work is cancelled and the handler
answers 499 quietly instead of raising into the ASGI server (which would log
a traceback per disconnect)."""
import asyncio
import logging

from kiln.frontends.kserve.http import CLIENT_CLOSED_REQUEST, _cancel_on_disconnect, _guard


class GoneRequest:
    """The part of a Starlette request `_cancel_on_disconnect` reads: the client is already gone."""

    async def receive(self):
        return {"type": "http.disconnect"}


def test_a_hang_up_cancels_the_work_and_answers_499_without_logging_an_error(caplog):
    started = asyncio.Event()
    cancelled = []

    async def work():
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    @_guard
    async def handler():
        return await _cancel_on_disconnect(GoneRequest(), work())

    async def main():
        response = await handler()
        await asyncio.sleep(0)  # let the cancelled task run its handler
        return response

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(main())
    assert response.status_code == CLIENT_CLOSED_REQUEST
    assert cancelled == [True]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class StaysConnected:
    """A client that never hangs up."""

    async def receive(self):
        await asyncio.sleep(60)


async def answer(suspend: bool) -> int:
    if suspend:
        await asyncio.sleep(0.01)  # the watcher starts meanwhile
    return 42


async def answered_and_tasks_left(suspend: bool):
    before = asyncio.all_tasks()
    result = await _cancel_on_disconnect(StaysConnected(), answer(suspend))
    if suspend:
        await asyncio.sleep(0)  # let the cancelled watcher finish
    return result, asyncio.all_tasks() - before


def test_work_that_finishes_first_is_returned_and_its_watcher_stopped():
    assert asyncio.run(answered_and_tasks_left(suspend=True)) == (42, set())


def test_work_that_never_suspends_starts_no_watcher_task():
    """A fast model's answer comes without yielding to the loop: no task is made for it."""
    assert asyncio.run(answered_and_tasks_left(suspend=False)) == (42, set())
