"""metrale's load generator (`metrale bench`): workloads, arrival processes, targets, metrics,
reports and plots. Needs the `bench` extra (httpx, matplotlib, psutil; mlx-lm for the comparison).

    from metrale.bench import BenchSettings, EngineTarget, random_requests, run_benchmark
    result = await run_benchmark(EngineTarget(engine), random_requests(32, 128, 128, vocab_size=v),
                                 BenchSettings(max_concurrency=32))
    result["output_throughput"], result["p99_ttft_ms"]
"""

from metrale.bench.arrivals import arrival_offsets
from metrale.bench.loadgen import BenchSettings, measure, run_benchmark, run_requests
from metrale.bench.stats import RequestRecord, summarize
from metrale.bench.targets import Chunk, EngineTarget, OpenAITarget, TargetError
from metrale.bench.workloads import BenchRequest, chat_requests, load_sharegpt, random_requests

__all__ = [
    "BenchRequest", "BenchSettings", "Chunk", "EngineTarget", "OpenAITarget", "RequestRecord", "TargetError",
    "arrival_offsets", "chat_requests", "load_sharegpt", "measure", "random_requests", "run_benchmark",
    "run_requests", "summarize",
]
