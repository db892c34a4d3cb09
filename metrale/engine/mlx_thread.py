"""The one thread where MLX runs.

MLX streams are thread-local, so every MLX operation (load, forward, sampling, eval, tolist) runs on
this single worker; the event loop awaits its results and is never blocked by them. Its last call
drops the thread's MLX state (kernels.runtime.release_thread_state: else the process can abort at exit).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from kernels.runtime import release_thread_state

T = TypeVar("T")


class MLXThread:
    """A single-worker executor; `await run(fn, ...)` executes fn on the MLX thread."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrale-mlx")
        self._released = False

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def shutdown(self, wait: bool = True) -> None:
        """Wait for the running call (if any) and stop the thread. wait=False leaves a call that can
        never return (a collective whose peer died) behind: the thread ends with it, or never.
        With wait, the thread's last call releases its MLX state (after the call in flight)."""
        if wait and not self._released:
            self._released = True
            self._executor.submit(release_thread_state).result()
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
