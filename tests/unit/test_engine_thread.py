"""All of a served engine's torch work runs on one thread, loading included: a second OpenMP team
(the HTTP thread's) stops libgomp's workers spinning, and every parallel op waits for one to wake."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from replica.engine.async_engine import AsyncEngine, EngineThread
from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


def test_calls_run_on_the_thread_and_raise_there() -> None:
    thread = EngineThread()
    first, second = thread.call(threading.get_ident), thread.call(threading.get_ident)
    assert first == second != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        thread.call(lambda: 1 // 0)
    ran: list[int] = []
    thread.run_last(lambda: ran.append(threading.get_ident()))
    thread.join()
    assert ran == [first] and not thread.is_alive()


async def test_the_model_loads_and_steps_on_one_thread(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: dict[str, set[int]] = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self: LLMEngine, *args: object, **kwargs: object) -> None:
        where["init"].add(threading.get_ident())
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    def recording_step(self: LLMEngine) -> list:  # type: ignore[type-arg]
        where["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = AsyncEngine.from_config(EngineConfig(model=llama_dir, dtype="float32", kv_cache_tokens=256))
    engine.start()
    try:
        outputs = [out async for out in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=3))]
    finally:
        await engine.shutdown()
    assert outputs[-1].finished
    assert len(where["init"]) == 1 and where["init"] == where["step"]
    assert threading.get_ident() not in where["init"]
