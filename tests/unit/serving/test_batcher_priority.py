"""The dynamic batcher's queue order by the KServe `priority` parameter."""
import asyncio

import numpy as np
import pytest

from kiln.errors import InvalidRequestError
from tests.unit.serving.test_batcher import make, req


def execution_order(requests, **config):
    """Values in the order their batches ran: the first request occupies the
    single instance while the rest queue up."""

    async def main():
        batcher, models, _ = make(delay=0.05, **config)
        seen: list[list[float]] = []
        run = models[0].run

        def recording(inputs):
            seen.append(inputs["IN"].reshape(-1).tolist())
            return run(inputs)

        models[0].run = recording
        first = asyncio.ensure_future(batcher.submit(req([[0.5]])))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(batcher.submit(r)) for r in requests]
        await asyncio.gather(first, *rest)
        await batcher.stop()
        return seen[1:]

    return asyncio.run(main())


def test_lower_priority_runs_first_and_ties_stay_in_arrival_order():
    requests = [req([[1.0]], priority=3), req([[2.0]], priority=1), req([[3.0]]), req([[4.0]], priority=1),
                req([[5.0]], priority=-1)]
    order = execution_order(requests, off=True)
    assert order == [[5.0], [3.0], [2.0], [4.0], [1.0]]


def test_batches_take_higher_priority_rows_first():
    requests = [req([[float(i)]], priority=p) for i, p in enumerate([2, 0, 2, 0, 1])]
    order = execution_order(requests, max_batch_size=2, max_queue_delay_ms=0)
    assert order == [[1.0, 3.0], [4.0, 0.0], [2.0]]


def test_aging_lets_an_old_request_pass_a_newer_better_one():
    # aging 0.001 s per level: priority 5 is worth 5 ms; the first request
    # waited longer than that, so it keeps its place.
    async def main():
        batcher, models, _ = make(delay=0.05, off=True, queue={"priority_aging_s": 0.001})
        seen = []
        run = models[0].run
        models[0].run = lambda inputs: (seen.append(float(inputs["IN"][0, 0])), run(inputs))[1]
        first = asyncio.ensure_future(batcher.submit(req([[0.0]])))
        await asyncio.sleep(0.005)
        old = asyncio.ensure_future(batcher.submit(req([[1.0]], priority=5)))
        await asyncio.sleep(0.02)
        new = asyncio.ensure_future(batcher.submit(req([[2.0]], priority=0)))
        await asyncio.gather(first, old, new)
        await batcher.stop()
        return seen

    assert asyncio.run(main()) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("bad", ["high", 1.5, True])
def test_a_non_integer_priority_is_a_400(bad):
    async def main():
        batcher, _, _ = make()
        try:
            await batcher.submit(req(np.ones((1, 1)), priority=bad))
        finally:
            await batcher.stop()

    with pytest.raises(InvalidRequestError, match="priority"):
        asyncio.run(main())
