"""Per-request timings and the benchmark summary, with vLLM bench's field names and definitions.

    TTFT  first output chunk - send time
    E2EL  last event (the end of the stream) - send time
    TPOT  (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token
    ITL   the gap between successive output chunks, one value per gap (a chunk that carries several
          tokens, e.g. merged deltas, is one gap, as in vLLM)

Only completed requests count in the latencies and token totals. A request that raised, got an
error event mid-stream, or ended without its final event is `failed`; one the client cancelled on
purpose (soak mode) is `cancelled` and counts in neither. Durations are in ms in the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (99.0,)  # vLLM's --metric-percentiles default


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are `time.perf_counter()` seconds."""

    prompt_len: int  # the workload's figure; replaced by the target's count when it reports one
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    output_tokens: int = 0
    error: str | None = None
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]


def latency_samples(records: Iterable[RequestRecord]) -> dict[str, list[float]]:
    """The completed requests' samples in seconds: {"ttft": [...], "tpot": [...], "itl": [...], "e2el": [...]}."""
    samples: dict[str, list[float]] = {name: [] for name in LATENCY_METRICS}
    for r in records:
        if not r.ok:
            continue
        if r.ttft is not None:
            samples["ttft"].append(r.ttft)
        if r.tpot is not None:
            samples["tpot"].append(r.tpot)
        samples["itl"].extend(r.itls)
        samples["e2el"].append(r.e2el)
    return samples


def summarize(records: Sequence[RequestRecord], duration_s: float,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """vLLM's BenchmarkMetrics fields: completed, failed, totals, throughputs, and mean / median /
    std / p<N> of ttft_ms, tpot_ms, itl_ms, e2el_ms (0 where there are no samples, as in vLLM)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None),
        "cancelled": sum(1 for r in records if r.cancelled and r.error is None),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    for name, values in latency_samples(records).items():
        result.update(_distribution(name, values, percentiles))
    return result


def _distribution(name: str, values_s: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        stats[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def details(records: Sequence[RequestRecord]) -> dict[str, list[Any]]:
    """Per-request lists, as vLLM's --save-detailed writes them (seconds, to the microsecond):
    input_lens, output_lens, ttfts, itls, e2els, errors. Every request appears, in workload order."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [_us(r.ttft) if r.ttft is not None else 0.0 for r in records],
        "itls": [[_us(x) for x in r.itls] for r in records],
        "e2els": [_us(r.e2el) for r in records],
        "errors": [r.error or ("cancelled" if r.cancelled else "") for r in records],
    }


def _us(seconds: float) -> float:
    return round(seconds, 6)
