"""ModelManager: every model of a catalog, each loaded on demand as its own engine under one memory budget.

    acquire(name, keep_alive) -> Lease     the model's engine, loading it first if needed (one load, however many
                                           requests arrive meanwhile; each waits for it, at most
                                           max_waiting_per_model of them); the lease holds the model resident
    lease.release()                        the request ended: the model's expiry is now + keep_alive
    reap(now)                              unload the idle models whose expiry has passed (a task calls it)

Loading a model that does not fit unloads the least recently used idle model (no lease) first, then the next,
until it fits; a model with a lease is never unloaded; when nothing more can be unloaded the load fails with
NoRoomError (503), not a wait. A failed load ends every request waiting for it with ModelLoadError and leaves
the model "failed" until the next request loads it again. An engine that dies takes only its model down: its
open requests end with the engine's error, and the next request loads the model again. Every unload is
engine.shutdown() (its KV pool and weights freed; with EngineConfig.engine_process the child process exits).

The event loop owns all of this state; only start() and shutdown() of the engines await.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from metrale.engine.protocol import EngineClient
from metrale.manager.budget import resident_estimate
from metrale.manager.catalog import ModelEntry
from metrale.manager.errors import (LoadQueueFullError, ManagerClosedError, ModelLoadError, NoRoomError,
                                    UnknownModelError)
from metrale.manager.metrics import ManagerMetrics
from metrale.manager.slot import ModelSlot

logger = logging.getLogger(__name__)
EngineFactory = Callable[[ModelEntry], EngineClient]


@dataclass(frozen=True)
class ManagerConfig:
    """max_resident_bytes: the budget of loaded models (budget.py counts each); kv_cache_bytes: each engine's KV
    pool; idle_unload_after_s: how long an idle model stays when its last request set no keep_alive (math.inf:
    forever); max_waiting_per_model: requests that may wait for one model's load (more get LoadQueueFullError);
    reap_interval_s: how often expiries are checked."""

    max_resident_bytes: int
    kv_cache_bytes: int
    idle_unload_after_s: float = 300.0
    max_waiting_per_model: int = 256
    reap_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_resident_bytes <= 0 or self.kv_cache_bytes < 0:
            raise ValueError(f"max_resident_bytes ({self.max_resident_bytes}) must be > 0 and kv_cache_bytes "
                             f"({self.kv_cache_bytes}) >= 0")
        if not self.idle_unload_after_s >= 0:
            raise ValueError(f"idle_unload_after_s must be >= 0 seconds (inf: never), not {self.idle_unload_after_s}")
        if self.max_waiting_per_model < 1 or not 0 < self.reap_interval_s <= 60:
            raise ValueError(f"max_waiting_per_model ({self.max_waiting_per_model}) must be >= 1 and "
                             f"reap_interval_s ({self.reap_interval_s}) in (0, 60]")


class Lease:
    """One request's hold on a loaded model; release() once the response has ended (idempotent)."""

    def __init__(self, manager: ModelManager, slot: ModelSlot, engine: EngineClient, keep_alive_s: float) -> None:
        self.engine = engine
        self.model_id = slot.model_id
        self._manager, self._slot, self._keep_alive_s = manager, slot, keep_alive_s
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._manager._release(self._slot, self._keep_alive_s)


class ModelManager:
    """The models of `entries` (the first is the default), each served by an engine `make_engine` builds."""

    def __init__(self, entries: list[ModelEntry], make_engine: EngineFactory, config: ManagerConfig, *,
                 clock: Callable[[], float] = time.time, metrics: ManagerMetrics | None = None) -> None:
        if not entries:
            raise ValueError("a model manager needs at least one model")
        self.config = config
        self.clock = clock
        self.make_engine = make_engine
        self.slots = {e.model_id: ModelSlot(e, resident_estimate(e.size_bytes, config.kv_cache_bytes))
                      for e in entries}
        self.default_model_id = entries[0].model_id
        self.metrics = metrics if metrics is not None else ManagerMetrics()
        self._state = "stopped"  # stopped -> serving -> draining -> stopped
        self._tasks: set[asyncio.Task] = set()  # the reaper and each engine's death watch

    # ---- requests ----

    async def acquire(self, requested: str | None, keep_alive_s: float | None = None) -> Lease:
        """A lease on the loaded engine of `requested` (None: the default model). Raises UnknownModelError,
        ManagerClosedError, LoadQueueFullError, NoRoomError or ModelLoadError; a cancelled wait leaves the load
        running for the others."""
        if self._state != "serving":
            raise ManagerClosedError(f"the server is {self._state}; no new request is served")
        slot = self._slot(requested)
        if slot.engine is None and slot.waiting >= self.config.max_waiting_per_model:
            raise LoadQueueFullError(f"{slot.waiting} requests already wait for model {slot.model_id!r} to load")
        keep_alive = self.config.idle_unload_after_s if keep_alive_s is None else keep_alive_s
        slot.leases += 1
        slot.last_used = self.clock()
        try:
            engine = await self._loaded_engine(slot)
        except BaseException:
            slot.leases -= 1
            self._expire_if_due(slot)
            raise
        return Lease(self, slot, engine, keep_alive)

    def _slot(self, requested: str | None) -> ModelSlot:
        slot = self.slots.get(self.default_model_id if requested is None else requested)
        if slot is None:
            raise UnknownModelError(str(requested), list(self.slots))
        return slot

    async def _loaded_engine(self, slot: ModelSlot) -> EngineClient:
        while slot.engine is None:  # a loop: the engine may die between its load and this waiter's turn
            if slot.loading is None:
                slot.loading = self._spawn(self._load(slot), f"metrale-load-{slot.model_id}")
            loading = slot.loading
            slot.waiting += 1
            try:
                await asyncio.shield(loading)
            except asyncio.CancelledError:
                if loading.cancelled() and not asyncio.current_task().cancelling():
                    raise ManagerClosedError(f"the server stopped while model {slot.model_id!r} loaded") from None
                raise  # this waiter was cancelled (its client left): the load goes on for the others
            finally:
                slot.waiting -= 1
        return slot.engine

    def _release(self, slot: ModelSlot, keep_alive_s: float) -> None:
        slot.leases -= 1
        slot.last_used = self.clock()
        slot.keep_alive_s = keep_alive_s  # each request resets the expiry (Ollama's rule)
        self._expire_if_due(slot)

    def _expire_if_due(self, slot: ModelSlot) -> None:
        """keep_alive 0: unload as soon as the last request holding the model has ended."""
        expires_at = slot.expires_at
        if expires_at is not None and expires_at <= slot.last_used and self._state == "serving":
            self._begin_unload(slot, "keep_alive")

    # ---- loading and unloading ----

    async def _load(self, slot: ModelSlot) -> None:
        try:
            if slot.unloading is not None:
                await asyncio.shield(slot.unloading)
            await self._make_room(slot)
            engine = self.make_engine(slot.entry)
            try:
                await engine.start()
            except BaseException:
                await engine.shutdown()  # frees what start built; an engine process exits
                raise
        except (NoRoomError, asyncio.CancelledError):
            raise
        except Exception as error:
            slot.last_error = f"{type(error).__name__}: {error}"
            logger.error("model %s failed to load: %s", slot.model_id, slot.last_error)
            self.metrics.loaded(slot.model_id, "error", 0)
            raise ModelLoadError(slot.model_id, slot.last_error) from error
        finally:
            slot.loading = None
        slot.engine, slot.last_error = engine, None
        self.metrics.loaded(slot.model_id, "ok", slot.resident_bytes)
        logger.info("model %s loaded (counted at %d MiB)", slot.model_id, slot.resident_bytes >> 20)
        self._spawn(self._watch(slot, engine), f"metrale-watch-{slot.model_id}")

    async def _make_room(self, slot: ModelSlot) -> None:
        """Unload LRU idle models until `slot` fits the budget (it is counted already: it is loading)."""
        budget = self.config.max_resident_bytes
        if slot.resident_bytes > budget:
            raise NoRoomError(f"model {slot.model_id!r} needs {slot.resident_bytes} bytes (weights + KV pool), more "
                              f"than the whole budget of {budget} (--max-resident-bytes)")
        while (used := sum(s.resident_bytes for s in self.slots.values() if s.holds_memory)) > budget:
            idle = [s for s in self.slots.values() if s.idle]
            if not idle:
                busy = ", ".join(s.model_id for s in self.slots.values() if s.holds_memory and s is not slot)
                raise NoRoomError(f"model {slot.model_id!r} does not fit: {used - slot.resident_bytes} of {budget} "
                                  f"bytes are held by models in use ({busy}); retry when one is idle")
            victim = min(idle, key=lambda s: s.last_used)
            logger.info("unloading idle model %s to make room for %s", victim.model_id, slot.model_id)
            await asyncio.shield(self._begin_unload(victim, "evicted"))

    def _begin_unload(self, slot: ModelSlot, reason: str) -> asyncio.Task:
        """Take the engine from the slot now (no request gets it after this) and shut it down in a task."""
        engine, slot.engine = slot.engine, None
        if engine is None:
            raise RuntimeError(f"model {slot.model_id!r} is {slot.status}: only a loaded model is unloaded")
        slot.unloading = self._spawn(self._unload(slot, engine, reason), f"metrale-unload-{slot.model_id}")
        return slot.unloading

    async def _unload(self, slot: ModelSlot, engine: EngineClient, reason: str) -> None:
        try:
            await engine.shutdown()
        finally:
            slot.unloading = None
            self.metrics.unloaded(slot.model_id, reason)
            logger.info("model %s unloaded (%s)", slot.model_id, reason)

    async def _watch(self, slot: ModelSlot, engine: EngineClient) -> None:
        """An engine that dies takes only its model down; the next request loads it again."""
        error = await engine.wait_until_dead()
        if error is None or slot.engine is not engine:
            return  # shut down by the manager
        slot.last_error = f"the engine died: {type(error).__name__}: {error}"
        logger.error("model %s: %s", slot.model_id, slot.last_error)
        self._begin_unload(slot, "died")

    def _spawn(self, coroutine, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and not task.get_name().startswith("metrale-load"):
            logger.error("%s failed", task.get_name(), exc_info=task.exception())

    # ---- idle unloads ----

    def reap(self, now: float) -> list[str]:
        """Begin unloading every idle model whose expiry has passed; their ids."""
        due = [s for s in self.slots.values() if s.expires_at is not None and s.expires_at <= now]
        for slot in due:
            self._begin_unload(slot, "idle")
        return [slot.model_id for slot in due]

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            self.reap(self.clock())

    # ---- lifecycle ----

    def health(self) -> str:
        """"serving" while requests are taken (whether or not a model is loaded yet) | "draining" | "stopped"."""
        return self._state

    async def start(self) -> None:
        """Start taking requests (no model is loaded until one is asked for)."""
        self._state = "serving"
        self._spawn(self._reap_forever(), "metrale-reaper")

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; let each loaded engine finish its requests for up to timeout_s."""
        self._state = "draining"
        engines = [s.engine for s in self.slots.values() if s.engine is not None]
        await asyncio.gather(*(engine.drain(timeout_s) for engine in engines))

    async def shutdown(self) -> None:
        """Cancel loads and background tasks, shut every engine down; leaves nothing running."""
        self._state = "stopped"
        for task in list(self._tasks):
            if not task.get_name().startswith("metrale-unload"):
                task.cancel()
        for slot in self.slots.values():
            if slot.engine is not None:
                self._begin_unload(slot, "shutdown")
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def abort_all(self) -> None:
        """Abort every open request of every loaded engine (a forced exit)."""
        for slot in self.slots.values():
            if slot.engine is not None and slot.engine.health() in ("serving", "draining", "unhealthy"):
                slot.engine.abort_all()

    def resident_bytes(self) -> int:
        return sum(s.resident_bytes for s in self.slots.values() if s.holds_memory)

