"""Engine doubles for the manager's policy: each records its start and shutdown; a gate holds its start; a
failure makes it raise; die() ends it as a native crash would."""

from __future__ import annotations

import asyncio

from metrale.manager.catalog import ModelEntry
from metrale.manager.manager import ManagerConfig, ModelManager
from tests.server.fakes import FakeEngine

MB = 1 << 20


class LoadableEngine(FakeEngine):
    """A FakeEngine with a real lifecycle: stopped until start(), which may wait on a gate or fail."""

    def __init__(self, entry: ModelEntry, gate: asyncio.Event | None = None, fail: Exception | None = None) -> None:
        super().__init__()
        self.model_name = entry.model_id
        self.entry = entry
        self.state = "stopped"
        self.gate = gate
        self.fail = fail
        self.max_model_len = 0
        self.starts = 0
        self.shutdowns = 0
        self._dead: asyncio.Future | None = None

    async def start(self) -> None:
        self.starts += 1
        self.state = "loading"
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.state, self.max_model_len = "serving", 64
        self._dead = asyncio.get_running_loop().create_future()

    async def shutdown(self) -> None:
        self.shutdowns += 1
        self.state, self.max_model_len = "stopped", 0
        if self._dead is not None and not self._dead.done():
            self._dead.set_result(None)

    async def wait_until_dead(self) -> BaseException | None:
        if self._dead is None:
            raise RuntimeError("wait_until_dead before a successful start")
        return await asyncio.shield(self._dead)

    def die(self, error: BaseException) -> None:
        self.state = "unhealthy"
        self._dead.set_result(error)


class Factory:
    """Builds LoadableEngines and remembers them; `gates` / `failures` per model id apply to its next engine."""

    def __init__(self) -> None:
        self.built: list[LoadableEngine] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.failures: dict[str, Exception] = {}

    def __call__(self, entry: ModelEntry) -> LoadableEngine:
        engine = LoadableEngine(entry, self.gates.get(entry.model_id), self.failures.pop(entry.model_id, None))
        self.built.append(engine)
        return engine

    def engines(self, model_id: str) -> list[LoadableEngine]:
        return [engine for engine in self.built if engine.entry.model_id == model_id]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_manager(sizes_mb: dict[str, int], budget_mb: int, *, kv_mb: int = 0, **config) -> tuple[ModelManager,
                                                                                                  Factory, Clock]:
    """A started-able manager over models of the given sizes, its engine factory and its clock."""
    entries = [ModelEntry(name, f"/models/{name}.gguf", size * MB) for name, size in sizes_mb.items()]
    factory, clock = Factory(), Clock()
    manager = ModelManager(entries, factory, ManagerConfig(max_resident_bytes=budget_mb * MB, kv_cache_bytes=kv_mb * MB,
                                                           **config), clock=clock)
    return manager, factory, clock
