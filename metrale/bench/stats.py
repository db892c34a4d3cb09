"""Per-request timings and the benchmark summary, with vLLM bench's field names and definitions.

    TTFT  first output chunk - send time
    E2EL  last event (the end of the stream) - send time
    TPOT  (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token
    ITL   the gap between successive output chunks, one value per gap (a chunk that carries several
          tokens, e.g. merged deltas, is one gap, as in vLLM)
    goodput  completed requests that meet every given SLO (`GoodputSLOs`, vLLM's --goodput), per
          second ("request_goodput") and as a share of the requests sent ("request_goodput_ratio")

Only completed requests count in the latencies and token totals. A request that raised, got an
error event mid-stream, or ended without its final event is `failed`; one the client cancelled on
purpose (soak mode) is `cancelled` and counts in neither. Durations are in ms in the summary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_SLOS = ("ttft", "tpot", "e2el")  # what --goodput can bound, per request
DEFAULT_PERCENTILES = (99.0,)  # vLLM's --metric-percentiles default


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are `time.perf_counter()` seconds."""

    prompt_len: int  # the workload's figure; replaced by the target's count when it reports one
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with output
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the target's prefix cache (when it reports them)
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


@dataclass(frozen=True)
class GoodputSLOs:
    """Service level objectives in ms (vLLM's `--goodput ttft:MS tpot:MS e2el:MS`, any subset).

    A request is good when it completed and each given SLO holds for it: TTFT <= ttft_ms,
    TPOT = (E2EL - TTFT) / (output tokens - 1) <= tpot_ms (0 for a one-token request, as in vLLM),
    E2EL <= e2el_ms."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        given = self.as_dict()
        if not given:
            raise ValueError("goodput needs at least one SLO: ttft, tpot or e2el")
        for name, value in given.items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"the {name} SLO must be a finite number of ms >= 0, got {value}")

    @classmethod
    def parse(cls, items: Sequence[str]) -> "GoodputSLOs":
        """From "name:ms" items, e.g. ["ttft:500", "tpot:50"]; ValueError names a bad item."""
        slos: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in LATENCY_SLOS:
                raise ValueError(f"bad goodput SLO {item!r}: give name:ms with name one of {', '.join(LATENCY_SLOS)}")
            if name in slos:
                raise ValueError(f"goodput SLO {name!r} given twice")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"bad goodput SLO {item!r}: {value!r} is not a number of ms") from None
        return cls(**{f"{name}_ms": ms for name, ms in slos.items()})

    def as_dict(self) -> dict[str, float]:
        """The given SLOs by metric name, in ms: {"ttft": 500.0, ...}."""
        values = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {name: float(ms) for name, ms in values.items() if ms is not None}

    def met_by(self, record: RequestRecord) -> bool:
        """Did this request complete within every SLO?"""
        if not record.ok:
            return False
        if self.ttft_ms is not None and (record.ttft is None or record.ttft * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and (record.tpot or 0.0) * 1e3 > self.tpot_ms:
            return False
        return self.e2el_ms is None or record.e2el * 1e3 <= self.e2el_ms


def goodput(records: Sequence[RequestRecord], duration_s: float, slos: GoodputSLOs) -> dict[str, Any]:
    """vLLM's request_goodput (good requests per second), with the count and the share of the
    requests sent (cancelled-on-purpose ones left out; failed ones count as not good)."""
    sent = [r for r in records if not (r.cancelled and r.error is None)]
    good = sum(1 for r in sent if slos.met_by(r))
    return {"goodput_slos_ms": slos.as_dict(), "good_requests": good, "request_goodput": good / duration_s,
            "request_goodput_ratio": good / len(sent) if sent else 0.0}


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
              percentiles: Sequence[float] = DEFAULT_PERCENTILES, slos: GoodputSLOs | None = None) -> dict[str, Any]:
    """vLLM's BenchmarkMetrics fields: completed, failed, totals, throughputs, goodput when `slos`
    are given, and mean / median / std / p<N> of ttft_ms, tpot_ms, itl_ms, e2el_ms (0 where there
    are no samples, as in vLLM)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    total_cached = sum(r.cached_tokens for r in done)
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": sum(1 for r in records if r.error is not None),
        "cancelled": sum(1 for r in records if r.cancelled and r.error is None),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached,
        "prefix_cache_hit_rate": total_cached / total_in if total_in else 0.0,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    if slos is not None:
        result.update(goodput(records, duration_s, slos))
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
