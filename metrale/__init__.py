"""metrale: an asynchronous continuous-batching LLM serving engine on MLX.

    from metrale import AsyncEngine, EngineConfig, SamplingParams
    async with AsyncEngine(EngineConfig()) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.text, end="")
"""

from kvcache.blas import preload_openblas

preload_openblas()  # before anything imports mlx.core: the fast BLAS on Linux CPU

from metrale.config import EngineConfig  # noqa: E402
from metrale.engine import AsyncEngine  # noqa: E402
from metrale.errors import (EngineDeadError, EngineDrainingError, QueueFullError,  # noqa: E402
                            RequestFailedError, RequestRejectedError)
from metrale.outputs import CompletionResult, EngineStats, RequestOutput, TokenLogprob, Usage  # noqa: E402
from metrale.sampling_params import SamplingParams  # noqa: E402
from metrale.stream import RequestStream  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "AsyncEngine", "CompletionResult", "EngineConfig", "EngineDeadError", "EngineDrainingError",
    "EngineStats", "QueueFullError", "RequestFailedError", "RequestOutput", "RequestRejectedError",
    "RequestStream", "SamplingParams", "TokenLogprob", "Usage",
]
