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


def describe(request_rate: float, burstiness: float, max_concurrency: int | None) -> str:
    """A short human label for an arrival setting, e.g. "poisson 0.5 req/s, max 8 in flight"."""
    if math.isinf(request_rate):
        kind = "all at once"
    elif burstiness == 1.0:
        kind = f"poisson {request_rate:g} req/s"
    else:
        kind = f"gamma {request_rate:g} req/s (burstiness {burstiness:g})"
    return kind if max_concurrency is None else f"{kind}, max {max_concurrency} in flight"
