"""AsyncLLM with the engine core in a thread of this process (the in-process mode)."""

from __future__ import annotations

import asyncio

import pytest

from kiln.config import EngineConfig
from kiln.errors import InvalidRequestError, PromptTooLongError
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.llm.sampling_params import SamplingParams


def run_with_engine(model_dir, body):
    async def main():
        engine = await AsyncLLM.start(EngineConfig.from_flat(model=str(model_dir), num_blocks=64), mode="thread")
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_generate_abort_and_errors_in_thread_mode(tiny_llama_dir):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def body(engine: AsyncLLM):
        async def text(rid: str) -> tuple[str, str]:
            out = None
            pieces = []
            async for out in engine.generate("Hello there", greedy, rid):
                pieces.append(out.delta_text)
            return "".join(pieces), out.outputs[0].text

        results = await asyncio.gather(*(text(f"r{i}") for i in range(4)))
        assert all(streamed == whole == results[0][0] for streamed, whole in results)

        stream = engine.add_request("long", "Hi", SamplingParams(max_tokens=400, ignore_eos=True))
        async for _ in stream:
            break  # leaving early aborts
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.latest_stats.kv_blocks_used == 0:
                break
        assert engine.latest_stats.kv_blocks_used == 0 and engine.num_in_flight == 0

        with pytest.raises(PromptTooLongError):
            engine.add_request("big", "hello " * 600, greedy)
        with pytest.raises(InvalidRequestError):
            engine.add_request("empty", "", greedy)
        assert engine.num_pending == 0

    run_with_engine(tiny_llama_dir, body)


def test_invalid_mode_is_refused(tiny_llama_dir):
    with pytest.raises(InvalidRequestError):
        asyncio.run(AsyncLLM.start(EngineConfig.from_flat(model=str(tiny_llama_dir)), mode="fork"))
