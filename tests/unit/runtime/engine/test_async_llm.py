"""AsyncLLMEngine on the real model: streams, concurrency, validation before the first
yield, abort (explicit and by closing the stream), a dead engine loop, shutdown."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.async_llm import AsyncLLMEngine, EngineDeadError
from kvfleet.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


class Recorder:
    def __init__(self) -> None:
        self.finished = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.finished.extend(iteration_stats.finished_requests)


def make(smollm2):
    recorder = Recorder()
    engine = AsyncLLMEngine(EngineConfig(kv_cache_memory=64 * 2**20), [recorder], loaded=smollm2)
    return engine, recorder


def usage(engine: AsyncLLMEngine) -> float:
    return engine.engine.scheduler.kv_cache_manager.usage


async def collect(engine, prompt, params, rid):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


def test_streams_concurrent_requests_and_validation(smollm2):
    async def main():
        engine, recorder = make(smollm2)
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("Hi", None, "early"):
                pass
        await engine.start()
        assert engine.is_running and not engine.errored and engine.dead_error is None
        greedy = SamplingParams(temperature=0, max_tokens=12)
        results = await asyncio.gather(
            collect(engine, "The capital of France is", greedy, "a"),
            collect(engine, "def add(a, b):", greedy, "b"),
            collect(engine, [1, 2, 3, 4], SamplingParams(max_tokens=5, n=2, seed=1), "c"),
        )
        for outs in results:
            assert outs[-1].finished and all(not o.finished for o in outs[:-1])
            texts = [o.outputs[0].text for o in outs]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert len(results[0][-1].outputs[0].token_ids) == 12
        assert len(results[2][-1].outputs) == 2
        # Same result as the synchronous engine path (greedy).
        assert "Paris" in results[0][-1].outputs[0].text

        # Validation errors: ValueError before anything is yielded; the engine keeps serving.
        for bad in ("", []):
            with pytest.raises(ValueError, match="prompt"):
                async for _ in engine.generate(bad, greedy, "bad"):
                    pytest.fail("yielded")
        with pytest.raises(ValueError, match="max_model_len"):
            await anext(engine.generate("word " * (engine.max_model_len + 1), greedy, "long"))
        gen = engine.generate("Hello", SamplingParams(max_tokens=50, ignore_eos=True), "dup")
        first = await anext(gen)
        with pytest.raises(ValueError, match="request_id"):
            await anext(engine.generate("Hello", greedy, "dup"))
        await gen.aclose()  # closing the stream aborts the request
        for _ in range(100):
            if usage(engine) == 0.0 and engine.num_running == 0:
                break
            await asyncio.sleep(0.05)
        assert usage(engine) == 0.0 and not first.finished
        assert engine.num_waiting == 0 and engine.num_running == 0
        await engine.shutdown()
        assert not engine.is_running
        return recorder

    recorder = asyncio.run(main())
    assert [f.finish_reason for f in recorder.finished].count("abort") == 1


def test_abort_frees_blocks_at_once(smollm2):
    async def main():
        engine, recorder = make(smollm2)
        await engine.start()
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        seen = []
        async with aclosing(engine.generate("Tell me a long story.", params, "x")) as stream:
            async for out in stream:
                seen.append(out)
                if len(seen) == 2:
                    assert usage(engine) > 0
                    await engine.abort("x")
                    assert usage(engine) == 0.0  # freed before abort() returned
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        assert len(seen[-1].outputs[0].token_ids) < 200
        await engine.abort("x")  # finished: ignored
        await engine.abort("unknown")
        assert await engine.reset_prefix_cache() is True
        await engine.shutdown()
        return recorder

    recorder = asyncio.run(main())
    assert [f.finish_reason for f in recorder.finished] == ["abort"]


def test_dead_engine_loop_is_reported(smollm2):
    async def main():
        engine, _ = make(smollm2)
        await engine.start()

        def boom(*args, **kwargs):
            raise RuntimeError("simulated device failure")

        engine.engine.runner.execute_model = boom
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=4), "r"):
                pass
        for _ in range(50):
            if not engine.is_running:
                break
            await asyncio.sleep(0.02)
        assert engine.errored and not engine.is_running
        assert isinstance(engine.dead_error, RuntimeError)
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("Hello", None, "r2"))
        await engine.shutdown()

    asyncio.run(main())
