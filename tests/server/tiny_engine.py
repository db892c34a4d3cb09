"""A tiny real engine behind the server app, in process, shared by a test module (import the fixtures):

    from tests.server.tiny_engine import app, clean, engine  # noqa: F401 (fixtures)

Module-scoped: the module's tests run on one event loop (`pytest.mark.asyncio(loop_scope="module")`)."""

from __future__ import annotations

import pytest
import pytest_asyncio

from metrale import AsyncEngine, EngineConfig
from metrale.server.app import ServerApp
from tests.metrale.engine_helpers import assert_clean, wait_idle


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    config = EngineConfig(model=tiny_model, kv_cache_bytes=2 << 20, block_size=4, max_num_seqs=16,
                          max_num_batched_tokens=128)
    async with AsyncEngine(config) as eng:
        yield eng


@pytest.fixture
def app(engine):
    return ServerApp(engine, manage_engine=False)


async def clean(engine) -> None:
    """Wait until the engine is idle, then check that every KV block is free."""
    await wait_idle(engine)
    assert_clean(engine)
