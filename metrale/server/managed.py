"""The multi-model server's models: metrale.manager's ModelManager behind the resolver protocol (resolve.py).

Each HTTP request gets a scope whose resolve() takes a lease on its model (loading it first when it is not
resident) and returns it when the response has ended. The manager's refusals become HTTP errors here:

    UnknownModelError     404 model_not_found (naming the models served)
    LoadQueueFullError    429 queue_full            too many requests already wait for that model's load
    NoRoomError           503 no_room               the model does not fit and every resident model is in use
    ModelLoadError        503 model_load_failed     the loader's message; the next request tries the load again
    ManagerClosedError    503 draining

/health is "serving" while the server takes requests, whether or not a model is loaded yet (one is loaded on
demand); /metrics is every loaded engine's series (model_name = the model's id here) and the manager's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from metrale.manager.errors import (LoadQueueFullError, ManagerClosedError, ModelLoadError, NoRoomError,
                                    UnknownModelError)
from metrale.manager.manager import Lease, ModelManager
from metrale.manager.metrics import merge_expositions, relabel
from metrale.server.errors import APIError
from metrale.server.resolve import ModelListing, ModelResolver, Target, model_not_found


class ManagedModels:
    """What ServerApp serves with `--models DIR` / `--model NAME=PATH`: every model of `manager`."""

    engine = None  # no single engine: the routes that describe one (/server_info, ...) answer 404

    def __init__(self, manager: ModelManager, server_exposition=lambda: b"") -> None:
        """`server_exposition`: the server process's own series (process, platform, GC collectors)."""
        self.manager = manager
        self._server_exposition = server_exposition
        self._stopped = asyncio.Event()

    @property
    def model_id(self) -> str:
        """The default model: the one a request that names none gets."""
        return self.manager.default_model_id

    @contextlib.asynccontextmanager
    async def request_scope(self) -> AsyncIterator[ModelResolver]:
        scope = _RequestModels(self)
        try:
            yield scope
        except APIError as error:
            if error.reject_reason is not None:  # counted here, on the model the request resolved, and only here
                scope.record_rejected(error.reject_reason)
                error.reject_reason = None
            raise
        finally:
            scope.release()

    def listing(self) -> list[ModelListing]:
        return [ModelListing(slot.model_id, (), slot.status, slot.engine, slot.entry.path, slot.entry.size_bytes,
                             slot.resident_bytes if slot.holds_memory else 0, slot.expires_at)
                for slot in self.manager.slots.values()]

    def ready(self) -> bool:
        return True

    def record_rejected(self, reason: str) -> None:
        self.manager.metrics.record_rejected(reason)

    # ---- lifecycle (ServerApp's) ----

    def health(self) -> str:
        return self.manager.health()

    async def start(self) -> None:
        self.manager.metrics.register_models(list(self.manager.slots))
        await self.manager.start()

    async def drain(self, timeout_s: float) -> None:
        await self.manager.drain(timeout_s)

    async def shutdown(self) -> None:
        try:
            await self.manager.shutdown()
        finally:
            self._stopped.set()

    def force_stop(self) -> None:
        self.manager.abort_all()

    async def wait_until_dead(self) -> BaseException | None:
        """None once shut down: an engine's death takes only its model down (the manager reloads it)."""
        await self._stopped.wait()
        return None

    def metrics_exposition(self) -> bytes:
        parts = [self._server_exposition(), self.manager.metrics.exposition()]
        parts += [relabel(slot.engine.metrics_exposition(), slot.model_id)
                  for slot in self.manager.slots.values() if slot.engine is not None]
        return merge_expositions(parts)


class _RequestModels:
    """One request's resolver: the leases it took, returned when the response has ended."""

    loads_on_demand = True

    def __init__(self, models: ManagedModels) -> None:
        self._models = models
        self._leases: list[Lease] = []

    async def resolve(self, requested: str | None, *, keep_alive: float | None = None) -> Target:
        manager = self._models.manager
        try:
            lease = await manager.acquire(requested, keep_alive)
        except UnknownModelError as error:
            raise model_not_found(error.requested, error.known) from None
        except LoadQueueFullError as error:
            raise APIError(429, f"server is busy: {error}", code="queue_full", reject_reason="queue_full") from None
        except NoRoomError as error:
            raise APIError(503, str(error), code="no_room") from None
        except ModelLoadError as error:
            raise APIError(503, str(error), code="model_load_failed") from None
        except ManagerClosedError:
            raise APIError(503, "server is shutting down and accepts no new requests", code="draining",
                           reject_reason="draining") from None
        self._leases.append(lease)
        return Target(lease.engine, lease.model_id)

    def record_rejected(self, reason: str) -> None:
        if self._leases:
            self._leases[-1].engine.record_rejected(reason)
        else:
            self._models.record_rejected(reason)

    def listing(self) -> list[ModelListing]:
        return self._models.listing()

    def ready(self) -> bool:
        return True

    def release(self) -> None:
        for lease in self._leases:
            lease.release()
        self._leases.clear()

