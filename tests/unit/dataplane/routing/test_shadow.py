"""Shadow copies run beside the caller and never reach it."""

import asyncio

from kiln.dataplane.routing.shadow import ShadowDispatcher


def test_a_failing_shadow_is_recorded_and_never_raised_to_the_caller():
    outcomes = []

    async def fail():
        await asyncio.sleep(0)
        raise RuntimeError("shadow broke")

    async def main():
        shadows = ShadowDispatcher()
        assert shadows.dispatch(fail, lambda error, seconds: outcomes.append((error, seconds)))
        await asyncio.sleep(0.01)
        return "caller's answer"

    assert asyncio.run(main()) == "caller's answer"
    (error, seconds), = outcomes
    assert isinstance(error, RuntimeError) and seconds >= 0


def test_a_hung_shadow_does_not_hold_the_caller_and_is_cancelled_at_close():
    outcomes = []
    never = asyncio.Event

    async def hang():
        await never().wait()

    async def main():
        shadows = ShadowDispatcher()
        shadows.dispatch(hang, lambda error, seconds: outcomes.append(error))
        await asyncio.sleep(0.01)
        assert len(shadows.tasks) == 1 and not outcomes
        await shadows.close()
        return len(shadows.tasks)

    assert asyncio.run(main()) == 0
    assert isinstance(outcomes[0], asyncio.CancelledError)


def test_copies_beyond_the_limit_are_dropped_not_queued():
    async def main():
        shadows = ShadowDispatcher(max_in_flight=2)
        gate = asyncio.Event()
        started = [shadows.dispatch(gate.wait, lambda e, s: None) for _ in range(3)]
        gate.set()
        await asyncio.sleep(0.01)
        return started, len(shadows.tasks)

    started, left = asyncio.run(main())
    assert started == [True, True, False] and left == 0
