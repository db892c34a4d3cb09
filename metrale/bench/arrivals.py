"""When each request is sent: all at once, or Poisson / gamma arrivals at a request rate.

The model is vLLM bench's: request rate `inf` sends everything at t=0; otherwise the gaps between
requests are gamma distributed with shape `burstiness` and scale 1 / (rate * burstiness), so the
mean gap is 1 / rate whatever the burstiness. burstiness 1 is a Poisson process (exponential
gaps); below 1 arrivals come in bursts, above 1 they are more even. A fixed concurrency is a cap
on in-flight requests applied on top of the schedule (`loadgen.run_requests`'s max_concurrency),
so "N closed-loop users" is rate inf with max_concurrency N.

    arrival_offsets(4, request_rate=2.0, seed=0)   # [0.0, 0.41, 0.53, 1.62]: seconds after the start
"""

from __future__ import annotations

import math
import random


def arrival_offsets(num_requests: int, request_rate: float = math.inf, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send times in seconds after the start, one per request, non-decreasing; the first is 0.

    Seeded: the same arguments always give the same schedule.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf sends all at once), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.gammavariate(burstiness, scale)
    return offsets


def ramp_offsets(num_requests: int, start_rate: float, end_rate: float, strategy: str = "linear",
                 seed: int = 0) -> list[float]:
    """Send times for a rate that ramps from `start_rate` to `end_rate` req/s over the run (vLLM's
    --ramp-up-strategy linear | exponential): request i arrives after an exponential gap at the rate of its
    place in the run, so a sweep of load levels fits in one run."""
    if not (0 < start_rate < math.inf and 0 < end_rate < math.inf):
        raise ValueError(f"ramp-up rates must be positive and finite, got {start_rate} -> {end_rate}")
    if strategy not in ("linear", "exponential"):
        raise ValueError(f"ramp-up strategy must be linear or exponential, got {strategy!r}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(num_requests):
        offsets.append(now)
        progress = i / max(1, num_requests - 1)
        rate = (start_rate + (end_rate - start_rate) * progress if strategy == "linear"
                else start_rate * (end_rate / start_rate) ** progress)
        now += rng.expovariate(rate)
    return offsets


def describe(request_rate: float, burstiness: float, max_concurrency: int | None) -> str:
    """A short human label for an arrival setting, e.g. "poisson 0.5 req/s, max 8 in flight"."""
    if math.isinf(request_rate):
        kind = "all at once"
    elif burstiness == 1.0:
        kind = f"poisson {request_rate:g} req/s"
    else:
        kind = f"gamma {request_rate:g} req/s (burstiness {burstiness:g})"
    return kind if max_concurrency is None else f"{kind}, max {max_concurrency} in flight"
