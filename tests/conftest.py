"""Shared fixtures: tiny random-weight models (built once per session) and engines over them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.local_redis import RedisServer
from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.kvcache.events import KVEventOutbox
from replica.tools.prepare_model import prepare_default_model
from replica.tools.tiny_models import make_test_model


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model, converted from its GGUF once per machine (cached)."""
    return prepare_default_model(progress=None)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture
def make_engine(llama_dir: Path) -> EngineFactory:
    """Builds an fp32 engine on the tiny Llama (or ``model=``), with an event outbox attached."""

    def build(model: Path | None = None, **settings: Any) -> LLMEngine:
        settings.setdefault("kv_cache_tokens", 4096)
        config = EngineConfig(model=model or llama_dir, dtype="float32", **settings)
        return LLMEngine(config, outbox=KVEventOutbox())

    return build


@pytest.fixture
def anyio_backend() -> str:
    """``async def`` tests (marked ``pytest.mark.anyio``) run on asyncio, as the product does."""
    return "asyncio"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh, private redis-server per test, killed afterwards."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
