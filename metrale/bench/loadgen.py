"""The load generator: send a workload to a target on an arrival schedule, time every chunk.

    records, duration = await run_requests(target, requests, request_rate=2.0, max_concurrency=8)
    result = await run_benchmark(target, requests, BenchSettings(request_rate=2.0), warmups=warm)

Each request is timed from the moment it is sent (after it gets a concurrency slot, as in vLLM)
to the end of its stream. The duration runs from the first send to the last request's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from metrale.bench.arrivals import arrival_offsets, ramp_offsets
from metrale.bench.stats import DEFAULT_PERCENTILES, GoodputSLOs, RequestRecord, details, summarize
from metrale.bench.progress import Progress
from metrale.bench.targets import Target
from metrale.bench.workloads import BenchRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchSettings:
    """How one run sends its requests (vLLM's --request-rate, --burstiness, --max-concurrency)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    duration_s: float | None = None  # stop sending after this long (the workload is the upper bound)
    ramp_up: tuple[str, float, float] | None = None  # (linear | exponential, start req/s, end req/s)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    def offsets(self, num_requests: int) -> list[float]:
        """When each request is sent, in seconds after the start."""
        if self.ramp_up is not None:
            strategy, start, end = self.ramp_up
            return ramp_offsets(num_requests, start, end, strategy, self.seed)
        return arrival_offsets(num_requests, self.request_rate, self.burstiness, self.seed)


async def measure(target: Target, request: BenchRequest, record: RequestRecord,
                  cancel_after_tokens: int | None = None) -> RequestRecord:
    """Run one request, filling `record` as chunks arrive. Failures are recorded, not raised (the
    error text goes into record.error); cancellation of the calling task marks it cancelled and
    propagates. `cancel_after_tokens` ends the stream early on purpose (soak mode)."""
    record.start = time.perf_counter()
    try:
        async with contextlib.aclosing(target.stream(request)) as chunks:
            async for chunk in chunks:
                now = time.perf_counter()
                if chunk.num_tokens:
                    record.chunk_times.append(now)
                    record.output_tokens += chunk.num_tokens
                if chunk.prompt_tokens is not None:
                    record.prompt_len = chunk.prompt_tokens
                if chunk.completion_tokens is not None:
                    record.output_tokens = chunk.completion_tokens
                if chunk.cached_tokens is not None:
                    record.cached_tokens = chunk.cached_tokens
                if cancel_after_tokens is not None and record.output_tokens >= cancel_after_tokens:
                    record.cancelled = True
                    break
    except asyncio.CancelledError:
        record.cancelled = True
        raise
    except Exception as error:  # any failure of the request is its result: counted as failed
        record.error = f"{type(error).__name__}: {error}"
        logger.debug("request failed", exc_info=True)
    finally:
        record.end = time.perf_counter()
    return record


async def run_requests(target: Target, requests: Sequence[BenchRequest], settings: BenchSettings = BenchSettings(),
                       progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Send every request on the schedule (until settings.duration_s, when set); returns (the records of the
    requests sent, in workload order, and the duration in s)."""
    offsets = settings.offsets(len(requests))
    limit = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    start = time.perf_counter()
    deadline = start + settings.duration_s if settings.duration_s is not None else math.inf
    sent: list[RequestRecord] = []

    async def one(request: BenchRequest, record: RequestRecord) -> None:
        async with limit if limit is not None else contextlib.nullcontext():
            if time.perf_counter() >= deadline:
                return  # its slot came after the end of a duration-bounded run: never sent
            sent.append(record)
            await measure(target, request, record)
        if progress is not None:
            progress.done(record.ok, record.output_tokens)

    tasks = []
    for request, record, offset in zip(requests, records, offsets):
        if start + offset >= deadline:
            break
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, record)))
    await asyncio.gather(*tasks)
    sent_ids = {id(r) for r in sent}
    records = [r for r in records if id(r) in sent_ids]
    duration = max((r.end for r in records), default=start) - start
    if progress is not None:
        progress.close()
    return records, max(duration, 1e-9)


async def run_benchmark(target: Target, requests: Sequence[BenchRequest], settings: BenchSettings = BenchSettings(),
                        *, warmups: Sequence[BenchRequest] = (), label: str = "",
                        percentiles: Sequence[float] = DEFAULT_PERCENTILES, show_progress: bool = True,
                        slos: GoodputSLOs | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm up (all warm-up requests at once, not counted), run, and summarize into one result
    dict with vLLM's field names (goodput too when `slos` are given) plus the settings and
    per-request details."""
    if warmups:
        warm, _ = await run_requests(target, warmups)
        failed = [r.error for r in warm if r.error]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(warm)} warm-up requests failed; first: {failed[0]}")
    progress = Progress(len(requests), label or target.name, enabled=show_progress)
    load_before = os.getloadavg()
    records, duration = await run_requests(target, requests, settings, progress)
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": target.name, "label": label, "num_prompts": len(records), "num_warmups": len(warmups),
        **{k: v for k, v in asdict(settings).items() if k != "seed"},
        "load_average_1m": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        **(extra or {}),
    }
    result["request_rate"] = "inf" if math.isinf(settings.request_rate) else settings.request_rate
    result.update(summarize(records, duration, percentiles, slos))
    result["details"] = details(records)
    return result
