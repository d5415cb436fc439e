"""Priority scheduling through a live `kiln serve` (issue 18): one running slot
(--max-num-seqs 1) held by a streaming request; two requests queue behind it,
the low-priority one first; the slot is freed by cutting the stream. Under
--scheduling-policy priority the later, more urgent request finishes first
(it may preempt the blocker, being strictly more urgent: kiln/llm/scheduler/
scheduler.py, then it never waits beside the other); under fcfs arrival order
holds. SmolLM2, not a tiny random model: the tiny model decodes the blocker's
tokens before the next request arrives. The blocker asks for 1,500 tokens (of
the 2,048 its 128 KV blocks hold), far more than the test needs the slot for."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.openai.live import kiln_server


def wait_for_waiting(server, count: int, unless: asyncio.Future | None = None, timeout: float = 30.0) -> None:
    """Until `count` requests wait (or `unless` is done)."""
    deadline = time.monotonic() + timeout
    while (waiting := server.metric("kiln:num_requests_waiting")) != count and not (unless and unless.done()):
        running = server.metric("kiln:num_requests_running")
        assert time.monotonic() < deadline, f"never {count} waiting (now {waiting} waiting, {running} running)"
        time.sleep(0.05)


async def finishing_order(server) -> list[str]:
    order: list[str] = []
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:

        async def complete(name: str, priority: int) -> None:
            r = await client.post("/v1/completions", json={"prompt": f"Request {name}", "max_tokens": 4,
                                                          "ignore_eos": True, "priority": priority})
            assert r.status_code == 200, r.text
            order.append(name)

        blocker = {"prompt": "Hold the slot", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=blocker) as stream:
            lines = stream.aiter_lines()  # kept: a dropped iterator closes the stream when collected
            await lines.__anext__()  # running: it holds the only slot
            low = asyncio.ensure_future(complete("low", 5))
            await asyncio.to_thread(wait_for_waiting, server, 1)
            urgent = asyncio.ensure_future(complete("urgent", -5))
            await asyncio.to_thread(wait_for_waiting, server, 2, urgent)  # done already if it preempted
        # leaving the block cut the stream: the blocker is aborted and the slot is free
        await asyncio.gather(low, urgent)
    return order


@pytest.mark.parametrize(("policy", "expected"), [("priority", ["urgent", "low"]), ("fcfs", ["low", "urgent"])])
def test_the_scheduling_policy_orders_queued_requests(smollm2_path, tmp_path, policy, expected):
    flags = ["--max-num-seqs", "1", "--scheduling-policy", policy, "--num-blocks", "128"]
    with kiln_server(smollm2_path, *flags, tmp_dir=tmp_path) as server:
        assert asyncio.run(finishing_order(server)) == expected
        assert server.metric("kiln:num_requests_running") == 0
