"""Chaos soak: many requests against the in-process engine, a fraction of them ended early five
different ways, with failpoints armed (EngineConfig(failpoints=...)); then the accounting must add up.

    result = await chaos_soak(engine, ChaosSettings(num_requests=10_000))
    result["verdict"], result["reasons"]

The five ways a consumer ends early, after a random number of deltas:
    aclose      `await stream.aclose()`
    break       `break` out of `async for` (the stream object stays referenced)
    raise       an exception in the loop's body, kept by the consumer
    cancel      the consuming task is cancelled
    abort       `engine.abort(request_id)`, then the stream is read to its end
PASS needs: no stream hung (each has `hang_timeout_s`), every request ended exactly once (the
outcomes add up to the requests sent), no more failed requests than failpoints fired, every KV
block free and the accounting intact at the end, and RSS after the run within `rss_tolerance_mib`
of RSS after the warm-up.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from metrale.errors import RequestFailedError
from metrale.sampling_params import SamplingParams

WAYS = ("aclose", "break", "raise", "cancel", "abort")


@dataclass(frozen=True)
class ChaosSettings:
    num_requests: int = 10_000
    concurrency: int = 64
    cancel_fraction: float = 0.2
    input_len: tuple[int, int] = (4, 40)
    output_len: tuple[int, int] = (1, 12)
    warmup_requests: int = 500
    hang_timeout_s: float = 60.0
    rss_tolerance_mib: float = 32.0
    seed: int = 0


class _ConsumerBug(Exception):
    """What the "raise" way throws inside the consumer's loop."""


async def _consume(engine: Any, index: int, rng: random.Random, settings: ChaosSettings, vocab: int) -> str:
    """One request, ended as chosen; returns its outcome: a finish reason, "failed" or "cancelled"."""
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*settings.input_len))]
    params = SamplingParams(max_tokens=rng.randint(*settings.output_len), temperature=rng.choice((0.0, 0.8)),
                            seed=index, ignore_eos=rng.random() < 0.5)
    way = rng.choice(WAYS) if rng.random() < settings.cancel_fraction else None
    after = rng.randint(0, 3)
    stream = engine.generate(prompt, params, request_id=f"chaos-{index}")
    if way == "cancel":
        task = asyncio.ensure_future(_read(stream))
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"
    return await _read(stream, way, after, engine)


async def _read(stream: Any, way: str | None = None, after: int = 0, engine: Any = None) -> str:
    seen, last = 0, None
    try:
        async for out in stream:
            last = out.finish_reason or last
            seen += 1
            if way is not None and seen > after and last is None:
                if way == "aclose":
                    await stream.aclose()
                    return "cancelled"
                if way == "break":
                    break
                if way == "raise":
                    raise _ConsumerBug()
                if way == "abort":
                    engine.abort(stream.request_id)
                    way = None  # read on: the stream must end with "abort"
    except _ConsumerBug:
        return "cancelled"
    except RequestFailedError:
        return "failed"
    return last or "cancelled"


async def _run_batch(engine: Any, first: int, count: int, settings: ChaosSettings, vocab: int) -> Counter:
    rng = random.Random(settings.seed + first)
    outcomes: Counter = Counter()
    gate = asyncio.Semaphore(settings.concurrency)

    async def one(index: int) -> None:
        async with gate:
            try:
                outcomes[await asyncio.wait_for(_consume(engine, index, rng, settings, vocab),
                                                settings.hang_timeout_s)] += 1
            except TimeoutError:
                outcomes["hung"] += 1

    await asyncio.gather(*(one(i) for i in range(first, first + count)))
    return outcomes


async def _wait_idle(engine: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_free == stats.kv_blocks_total:
            return True
        await asyncio.sleep(0.02)
    return False


def _rss_mib() -> float:
    import psutil

    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


async def chaos_soak(engine: Any, settings: ChaosSettings = ChaosSettings()) -> dict[str, Any]:
    """Run the soak on a started engine; returns counts, memory, the verdict and its reasons."""
    vocab = engine.vocab_size
    started = time.perf_counter()
    outcomes = await _run_batch(engine, 0, settings.warmup_requests, settings, vocab)
    await _wait_idle(engine, settings.hang_timeout_s)
    rss_warm = _rss_mib()
    outcomes += await _run_batch(engine, settings.warmup_requests, settings.num_requests - settings.warmup_requests,
                                 settings, vocab)
    idle = await _wait_idle(engine, settings.hang_timeout_s)
    rss_end = _rss_mib()
    fired = dict(engine.failpoints_fired())
    result: dict[str, Any] = {
        "settings": asdict(settings), "outcomes": dict(outcomes), "sent": settings.num_requests,
        "failpoints_fired": fired, "rss_after_warmup_mib": round(rss_warm, 1), "rss_end_mib": round(rss_end, 1),
        "idle_at_end": idle, "duration_s": round(time.perf_counter() - started, 1),
    }
    reasons = []
    if outcomes["hung"]:
        reasons.append(f"{outcomes['hung']} streams hung past {settings.hang_timeout_s:g} s")
    if sum(outcomes.values()) != settings.num_requests:
        reasons.append(f"outcomes add up to {sum(outcomes.values())}, not {settings.num_requests}")
    if outcomes["failed"] > sum(fired.values()):
        reasons.append(f"{outcomes['failed']} failed requests but only {sum(fired.values())} faults fired")
    try:
        engine.check_integrity()
    except RuntimeError as error:
        reasons.append(f"KV integrity: {error}")
    if not idle:
        reasons.append(f"not idle at the end: {engine.stats()}")
    if rss_end - rss_warm > settings.rss_tolerance_mib:
        reasons.append(f"RSS grew {rss_end - rss_warm:.1f} MiB after the warm-up (tolerance "
                       f"{settings.rss_tolerance_mib:g} MiB)")
    result["verdict"], result["reasons"] = ("FAIL" if reasons else "PASS"), reasons
    return result
