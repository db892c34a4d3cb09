"""The engine streams of a /v1/completions request with a list of prompts, read as one stream.

    prompts [p0, p1]  n=2   ->  engine streams s0 (p0, sequences 0..1), s1 (p1, sequences 0..1)
    choice index = prompt_i * n + j        (OpenAI's and vLLM's order: s1's sequence 1 is choice 3)

Deltas come in the order the engine produces them, whichever prompt they belong to, so no prompt waits
for another to finish; closing the batch closes (aborts) every stream still open.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from metrale.outputs import RequestOutput

logger = logging.getLogger(__name__)


class PromptBatchStream:
    """One async iterator over the streams of several prompts, each delta re-indexed as prompt_i * n + j."""

    def __init__(self, streams: list[Any], n: int) -> None:
        self._streams = streams
        self._n = n  # sequences per prompt
        self._pending: dict[asyncio.Future, int] = {}  # each open stream's next delta -> its prompt index
        self._started = False

    def __aiter__(self) -> PromptBatchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._started:
            self._started = True
            for prompt_index in range(len(self._streams)):
                self._read_next(prompt_index)
        while self._pending:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            future = min(done, key=self._pending.__getitem__)  # the lowest prompt first when several are ready
            prompt_index = self._pending.pop(future)
            try:
                out = future.result()  # a failed request raises here, as a single stream would
            except StopAsyncIteration:
                continue
            self._read_next(prompt_index)
            return msgspec.structs.replace(out, index=prompt_index * self._n + out.index)
        raise StopAsyncIteration

    def _read_next(self, prompt_index: int) -> None:
        future = asyncio.ensure_future(self._streams[prompt_index].__anext__())
        self._pending[future] = prompt_index

    async def aclose(self) -> None:
        """Stop reading and close every stream (a no-op for finished ones; aborts the others)."""
        pending = list(self._pending)
        self._pending.clear()
        for future in pending:
            future.cancel()
        results = await asyncio.gather(*pending, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception) and not isinstance(result, StopAsyncIteration):
                logger.info("a stream of a closed prompt batch had failed: %s: %s", type(result).__name__, result)
        for stream in self._streams:
            await stream.aclose()
