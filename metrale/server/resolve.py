"""Which engine serves a request: the one place a request's `model` is resolved.

Every surface (completions.py, responses.py, anthropic.py, ollama.py, tokenize.py) decodes its body, then asks
the request's ModelResolver for a Target once, and serves the request with it:

    app.py:  async with models.request_scope() as resolver:      one scope per HTTP request
                 await surface.handle(resolver, ...)
    surface: target = await resolver.resolve(request.model)      404 for a model not served; may wait for a load
             target.engine.generate(...); report target.model_id

A scope holds what its request resolved until the response ends (a model manager never unloads a model a request
is using). `SingleModel` is the one-engine server (`--model PATH`): one id, its aliases, nothing to load. The
multi-model server's resolver (managed.py) answers the same protocol over metrale.manager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from metrale.engine.protocol import EngineClient
from metrale.server.errors import APIError


@dataclass(frozen=True)
class Target:
    """What a request's `model` resolved to: the engine that serves it, the model id its responses report, and the
    LoRA adapter applied on top (None: the base model)."""

    engine: EngineClient
    model_id: str
    adapter: str | None = None


@dataclass(frozen=True)
class ModelListing:
    """One model the server answers for, as /v1/models, /api/tags and /api/ps list it.

    status: "loaded" | "loading" | "unloaded" | "failed"; engine: set while loaded; path: its file or folder ("" when
    unknown); size_bytes: on disk (0 when unknown); resident_bytes: weights + KV pool while loaded; expires_at: the
    unix time the idle model unloads at (None: never); parent: for a LoRA adapter, the model it runs on (its path is
    the adapter's folder)."""

    model_id: str
    aliases: tuple[str, ...] = ()
    status: str = "loaded"
    engine: EngineClient | None = None
    path: str = ""
    size_bytes: int = 0
    resident_bytes: int = 0
    expires_at: float | None = None
    parent: str | None = None


class ModelSet(Protocol):
    """All the models a ServerApp serves, with their lifecycle: SingleModel, or managed.ManagedModels."""

    engine: EngineClient | None  # the one engine of a one-model server; None when models load on demand

    @property
    def model_id(self) -> str:
        """The model a request that names none gets."""

    def request_scope(self) -> contextlib.AbstractAsyncContextManager[ModelResolver]:
        """One HTTP request's resolver; what it resolved is held until the scope ends."""

    def listing(self) -> list[ModelListing]: ...
    def record_rejected(self, reason: str) -> None: ...
    def health(self) -> str: ...
    async def start(self) -> None: ...
    async def drain(self, timeout_s: float) -> None: ...
    async def shutdown(self) -> None: ...
    def force_stop(self) -> None: ...
    async def wait_until_dead(self) -> BaseException | None: ...
    def metrics_exposition(self) -> bytes: ...


class ModelResolver(Protocol):
    """Resolves the `model` of one HTTP request (see the module docstring)."""

    loads_on_demand: bool  # models are loaded and unloaded as requests ask (keep_alive applies)

    async def resolve(self, requested: str | None, *, keep_alive: float | None = None) -> Target:
        """The target for `requested` (None: the default model); raises APIError: 404 for a model not served,
        503 for one that cannot be loaded now. keep_alive (seconds; 0: unload after this request, negative: keep
        forever) sets how long the model stays resident once idle, where models are loaded on demand."""

    def record_rejected(self, reason: str) -> None:
        """Count a request refused before it reached an engine (a REJECT_REASONS label)."""

    def listing(self) -> list[ModelListing]:
        """Every model this server answers for."""

    def ready(self) -> bool:
        """Whether the server can answer model requests now (False while a one-model server loads its model)."""


def model_not_found(requested: str, served: list[str]) -> APIError:
    """The 404 for a model this server does not serve, naming the ones it does."""
    names = ", ".join(repr(name) for name in served[:8]) + (", ..." if len(served) > 8 else "")
    what = f"this server serves {names}" if len(served) == 1 else f"this server serves {len(served)} models: {names}"
    return APIError(404, f"model {requested!r} does not exist; {what}", param="model", code="model_not_found",
                    reject_reason="invalid_request")


class SingleModel:
    """The one-engine server's models: `engine` under `served_model_name` (the engine's model name by default) and
    `aliases` (other ids answered as it, e.g. "unknown", which sglang-router sends for a chat request without one),
    and the engine's registered LoRA adapters, each a model id that runs `engine` with it."""

    loads_on_demand = False  # the model stays resident for the server's life

    def __init__(self, engine: EngineClient, served_model_name: str | None = None,
                 aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self._served_model_name = served_model_name
        self.aliases = tuple(aliases)

    @property
    def model_id(self) -> str:
        return self._served_model_name or self.engine.model_name

    @contextlib.asynccontextmanager
    async def request_scope(self) -> AsyncIterator[ModelResolver]:
        yield self  # nothing is loaded or held per request

    async def resolve(self, requested: str | None, *, keep_alive: float | None = None) -> Target:
        if requested is None or requested == self.model_id or requested in self.aliases:
            return Target(self.engine, self.model_id)
        if self.ready() and requested in self.engine.list_loras():
            return Target(self.engine, requested, adapter=requested)
        raise model_not_found(requested, [self.model_id])

    def record_rejected(self, reason: str) -> None:
        self.engine.record_rejected(reason)

    def listing(self) -> list[ModelListing]:
        started = self.engine.max_model_len > 0
        base = ModelListing(self.model_id, self.aliases, "loaded" if started else "loading", self.engine)
        adapters = self.engine.list_loras().items() if started else ()
        return [base, *(ModelListing(name, engine=self.engine, path=path, parent=self.model_id) for name, path in adapters)]

    def ready(self) -> bool:
        return self.engine.max_model_len > 0

    # ---- lifecycle (ServerApp's) ----

    def health(self) -> str:
        return self.engine.health()

    async def start(self) -> None:
        await self.engine.start()

    async def drain(self, timeout_s: float) -> None:
        await self.engine.drain(timeout_s)

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    def force_stop(self) -> None:
        if self.engine.health() in ("serving", "draining", "unhealthy"):
            self.engine.abort_all()

    async def wait_until_dead(self) -> BaseException | None:
        return await self.engine.wait_until_dead()

    def metrics_exposition(self) -> bytes:
        return self.engine.metrics_exposition()
