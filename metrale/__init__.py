"""metrale: an asynchronous continuous-batching LLM serving engine on MLX.

    from metrale import AsyncEngine, EngineConfig, SamplingParams
    async with AsyncEngine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")

    from metrale import LLM                      # the blocking API, for scripts and batch jobs
    with LLM(EngineConfig()) as llm:
        results = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32))

The names below are loaded on first use (PEP 562), so `import metrale.text` or `import
metrale.sampling_params` never loads MLX or the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEngine": "metrale.engine.async_engine",
    "LLM": "metrale.engine.llm",
    "CompletionStream": "metrale.engine.llm",
    "RequestStream": "metrale.engine.stream",
    "EngineConfig": "metrale.config",
    "SamplingParams": "metrale.sampling_params",
    "CompletionResult": "metrale.outputs",
    "EngineStats": "metrale.outputs",
    "RequestOutput": "metrale.outputs",
    "TokenLogprob": "metrale.outputs",
    "Usage": "metrale.outputs",
    "EngineDeadError": "metrale.errors",
    "EngineDrainingError": "metrale.errors",
    "EngineNotRunningError": "metrale.errors",
    "QueueFullError": "metrale.errors",
    "RequestFailedError": "metrale.errors",
    "RequestRejectedError": "metrale.errors",
}
__all__ = [
    "AsyncEngine",
    "CompletionResult",
    "CompletionStream",
    "EngineConfig",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineNotRunningError",
    "EngineStats",
    "LLM",
    "QueueFullError",
    "RequestFailedError",
    "RequestOutput",
    "RequestRejectedError",
    "RequestStream",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads them
    from metrale.config import EngineConfig
    from metrale.engine.async_engine import AsyncEngine
    from metrale.engine.llm import LLM, CompletionStream
    from metrale.engine.stream import RequestStream
    from metrale.errors import (EngineDeadError, EngineDrainingError, EngineNotRunningError, QueueFullError,
                                RequestFailedError, RequestRejectedError)
    from metrale.outputs import CompletionResult, EngineStats, RequestOutput, TokenLogprob, Usage
    from metrale.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metrale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
