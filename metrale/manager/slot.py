"""One model's state in the manager: which engine serves it, who holds it, when it may be unloaded.

    unloaded --first request--> loading --start() ok--> loaded --idle past its expiry / evicted / keep_alive 0-->
        ^                          |                      |                                              unloading
        |                          +--start() failed----> failed (the next request loads again)            |
        +--------------------------------------------------------------------------------------------------+
                                                          +--engine died--> failed (the next request loads again)

`leases` counts the requests holding the model: those waiting for its load and those running on it. A model with
a lease is never unloaded; its expiry (last release + keep_alive) only counts once the last lease is returned.
"""

from __future__ import annotations

import asyncio
import math

from metrale.engine.protocol import EngineClient
from metrale.manager.catalog import ModelEntry


class ModelSlot:
    """The manager's record of one model (the manager is its only writer)."""

    def __init__(self, entry: ModelEntry, resident_bytes: int) -> None:
        self.entry = entry
        self.resident_bytes = resident_bytes  # counted against the budget while loading, loaded or unloading
        self.engine: EngineClient | None = None
        self.loading: asyncio.Task | None = None  # the load in flight; every waiter awaits it
        self.unloading: asyncio.Task | None = None  # the engine's shutdown in flight
        self.leases = 0
        self.waiting = 0  # of the leases, those waiting for the load
        self.last_used = 0.0  # clock at the last acquire or release (LRU order)
        self.keep_alive_s = math.inf  # of the last request: how long the model stays once idle
        self.last_error: str | None = None  # of the last failed load or engine death, until a load succeeds

    @property
    def model_id(self) -> str:
        return self.entry.model_id

    @property
    def status(self) -> str:
        """"loading" | "loaded" | "unloading" | "failed" | "unloaded"."""
        if self.loading is not None:
            return "loading"
        if self.engine is not None:
            return "loaded"
        if self.unloading is not None:
            return "unloading"
        return "failed" if self.last_error is not None else "unloaded"

    @property
    def holds_memory(self) -> bool:
        """Counted against the budget: loading, loaded or still shutting down."""
        return self.loading is not None or self.engine is not None or self.unloading is not None

    @property
    def idle(self) -> bool:
        """Loaded and held by no request: may be unloaded."""
        return self.engine is not None and self.loading is None and self.leases == 0

    @property
    def expires_at(self) -> float | None:
        """Clock time the idle model unloads at; None while held, not loaded, or kept forever."""
        if not self.idle or math.isinf(self.keep_alive_s):
            return None
        return self.last_used + self.keep_alive_s
