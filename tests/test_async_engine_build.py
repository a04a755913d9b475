"""`AsyncEngine.build`: the engine is built on the thread that then runs its steps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from qiao.config import EngineConfig
from qiao.engine.async_engine import AsyncEngine
from qiao.engine.llm_engine import LLMEngine
from qiao.sampling_params import SamplingParams


def test_build_loads_and_steps_on_one_thread(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def factory() -> LLMEngine:
        threads["build"].add(threading.get_ident())
        engine = LLMEngine(EngineConfig.create(path, device="cpu", max_model_len=64))
        original = engine.step

        def step():
            threads["step"].add(threading.get_ident())
            return original()

        engine.step = step
        return engine

    engine = AsyncEngine.build(factory)
    assert threads["build"] and threading.get_ident() not in threads["build"]

    async def generate() -> list[int]:
        engine.start()
        try:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            tokens: list[int] = []
            async for output in engine.generate("r0", [5, 6, 7], params):
                tokens += output.outputs[0].token_ids  # streamed: each output is a delta
            return tokens
        finally:
            engine.shutdown()

    assert len(asyncio.run(generate())) == 4
    assert threads["step"] == threads["build"]
    assert not engine._thread.is_alive()


def test_build_raises_what_the_factory_raised():
    def factory() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.build(factory)


def test_a_built_engine_that_never_started_shuts_down(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = AsyncEngine.build(lambda: LLMEngine(EngineConfig.create(path, device="cpu")))
    engine.shutdown()
    assert not engine._thread.is_alive()
