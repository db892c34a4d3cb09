"""Soak mode: a long run against the in-process engine with a fraction of requests cancelled at
random points, sampling RSS and free KV blocks, with idle windows that must return to baseline.

    result = await soak(engine, SoakSettings(duration_s=180))
    result["verdict"]   # "PASS" or "FAIL"; result["reasons"] says why

The run is a series of cycles: `cycle_s` of Poisson arrivals, a wait until every request has
ended, then `idle_s` idle. Each cancelled request (`cancel_fraction`) ends either after a random
number of output tokens (the consumer leaves the stream) or after a random delay (its task is
cancelled: queued, in prefill or in decode). PASS needs, at every idle check, free KV blocks equal
to the baseline, nothing running or waiting and the KV accounting intact; no failed request; and
RSS at the last idle check within `rss_tolerance_mib` of the first one (a plateau, not growth).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from metrale.bench.arrivals import arrival_offsets
from metrale.bench.loadgen import measure
from metrale.bench.stats import RequestRecord
from metrale.bench.targets import EngineTarget
from metrale.bench.workloads import random_requests


@dataclass(frozen=True)
class SoakSettings:
    """Knobs of a soak run (seconds, requests per second, tokens)."""

    duration_s: float = 180.0
    cycle_s: float = 40.0
    idle_s: float = 4.0
    request_rate: float = 1.0
    input_len: int = 64
    output_len: int = 48
    range_ratio: float = 0.5
    cancel_fraction: float = 0.2
    max_cancel_delay_s: float = 5.0
    sample_every_s: float = 1.0
    rss_tolerance_mib: float = 64.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"cancel_fraction must be in [0, 1], got {self.cancel_fraction}")
        for name in ("duration_s", "cycle_s", "request_rate", "sample_every_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def rss_mib() -> float:
    """This process's resident set size in MiB."""
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def snapshot(engine: Any, t0: float) -> dict[str, Any]:
    """One sample: time, RSS, MLX active memory, free KV blocks, running, waiting."""
    from kernels.runtime import mx

    stats = engine.stats()
    return {"t": round(time.perf_counter() - t0, 3), "rss_mib": round(rss_mib(), 1),
            "mlx_active_mib": round(mx.get_active_memory() / 2**20, 1), "kv_blocks_free": stats.kv_blocks_free,
            "running": stats.running, "waiting": stats.waiting}


async def _sampler(engine: Any, t0: float, every_s: float, samples: list[dict[str, Any]]) -> None:
    while True:
        samples.append(snapshot(engine, t0))
        await asyncio.sleep(every_s)


async def _cycle(target: EngineTarget, settings: SoakSettings, cycle: int, vocab_size: int) -> list[RequestRecord]:
    """One load phase: Poisson arrivals for cycle_s, some requests cancelled; waits for all to end."""
    rng = random.Random(settings.seed * 1000 + cycle)
    n = max(1, round(settings.request_rate * settings.cycle_s))
    requests = random_requests(n, settings.input_len, settings.output_len, seed=rng.randrange(2**31),
                               range_ratio=settings.range_ratio, vocab_size=vocab_size)
    offsets = arrival_offsets(n, settings.request_rate, seed=rng.randrange(2**31))
    records = [RequestRecord(prompt_len=r.prompt_len) for r in requests]
    tasks, start = [], time.perf_counter()
    for request, record, offset in zip(requests, records, offsets):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        after_tokens, cancel_delay = None, None
        if rng.random() < settings.cancel_fraction:
            if rng.random() < 0.5:
                after_tokens = rng.randint(1, max(1, request.output_len - 1))
            else:
                cancel_delay = rng.uniform(0.0, settings.max_cancel_delay_s)
        task = asyncio.create_task(measure(target, request, record, cancel_after_tokens=after_tokens))
        if cancel_delay is not None:
            asyncio.get_running_loop().call_later(cancel_delay, task.cancel)
        tasks.append(task)
    for record, outcome in zip(records, await asyncio.gather(*tasks, return_exceptions=True)):
        if isinstance(outcome, asyncio.CancelledError):
            record.cancelled = True  # also when cancelled before it started
        elif isinstance(outcome, BaseException):
            raise outcome
    return records


async def _idle_check(engine: Any, settings: SoakSettings, t0: float, baseline: dict[str, Any]) -> dict[str, Any]:
    t_start = round(time.perf_counter() - t0, 3)
    await asyncio.sleep(settings.idle_s)
    check = {"t_start": t_start, **snapshot(engine, t0), "integrity": "ok"}
    try:
        engine.check_integrity()
    except RuntimeError as error:  # a broken invariant: the soak's finding, reported in the verdict
        check["integrity"] = str(error)
    check["ok"] = (check["kv_blocks_free"] == baseline["kv_blocks_free"] and check["running"] == 0
                   and check["waiting"] == 0 and check["integrity"] == "ok")
    return check


def verdict(result: dict[str, Any], settings: SoakSettings) -> tuple[str, list[str]]:
    """("PASS" | "FAIL", reasons) for a soak result."""
    reasons = [f"idle check at {c['t']:.0f} s: free blocks {c['kv_blocks_free']} (baseline "
               f"{result['baseline']['kv_blocks_free']}), running {c['running']}, waiting {c['waiting']}, "
               f"integrity {c['integrity']}" for c in result["idle_checks"] if not c["ok"]]
    if result["failed"]:
        reasons.append(f"{result['failed']} requests failed; first: {result['first_error']}")
    checks = result["idle_checks"]
    if len(checks) < 2:
        reasons.append(f"only {len(checks)} idle checks: run longer to judge the RSS plateau")
    elif result["rss_growth_mib"] > settings.rss_tolerance_mib:
        reasons.append(f"RSS grew {result['rss_growth_mib']:.1f} MiB from the first idle check to the last "
                       f"(tolerance {settings.rss_tolerance_mib:g} MiB)")
    return ("FAIL" if reasons else "PASS"), reasons


async def soak(engine: Any, settings: SoakSettings = SoakSettings()) -> dict[str, Any]:
    """Run the soak on a started engine; returns samples, idle checks, counts and the verdict."""
    target = EngineTarget(engine, name="metrale-soak")
    vocab = engine.vocab_size
    t0 = time.perf_counter()
    baseline = snapshot(engine, t0)
    samples: list[dict[str, Any]] = []
    sampler = asyncio.create_task(_sampler(engine, t0, settings.sample_every_s, samples))
    records: list[RequestRecord] = []
    checks: list[dict[str, Any]] = []
    try:
        cycle = 0
        while time.perf_counter() - t0 < settings.duration_s:
            records += await _cycle(target, settings, cycle, vocab)
            checks.append(await _idle_check(engine, settings, t0, baseline))
            cycle += 1
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    errors = [r.error for r in records if r.error]
    result: dict[str, Any] = {
        "settings": asdict(settings), "baseline": baseline, "samples": samples, "idle_checks": checks,
        "requests": len(records), "completed": sum(r.ok for r in records),
        "cancelled": sum(r.cancelled and r.error is None for r in records), "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "output_tokens": sum(r.output_tokens for r in records),
        "rss_growth_mib": round(checks[-1]["rss_mib"] - checks[0]["rss_mib"], 1) if checks else 0.0,
        "peak_rss_mib": max((s["rss_mib"] for s in samples), default=baseline["rss_mib"]),
        "duration": round(time.perf_counter() - t0, 1),
    }
    result["verdict"], result["reasons"] = verdict(result, settings)
    return result


def format_soak(result: dict[str, Any]) -> str:
    """A short console report of a soak result."""
    lines = [f"soak {result['verdict']}: {result['requests']} requests in {result['duration']:.0f} s, "
             f"{result['completed']} completed, {result['cancelled']} cancelled, {result['failed']} failed",
             f"baseline: RSS {result['baseline']['rss_mib']:.0f} MiB, free KV blocks "
             f"{result['baseline']['kv_blocks_free']}; peak RSS {result['peak_rss_mib']:.0f} MiB"]
    for c in result["idle_checks"]:
        lines.append(f"  idle at {c['t']:6.0f} s: RSS {c['rss_mib']:7.1f} MiB, MLX active {c['mlx_active_mib']:7.1f} MiB, "
                     f"free blocks {c['kv_blocks_free']}, running {c['running']}, waiting {c['waiting']}, "
                     f"integrity {c['integrity']}")
    lines.append(f"RSS growth first -> last idle check: {result['rss_growth_mib']:+.1f} MiB")
    lines += [f"  reason: {r}" for r in result["reasons"]]
    return "\n".join(lines)
