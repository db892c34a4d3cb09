"""The chaos soak on a tiny model (issue #11): requests ended early five ways (20%), every failpoint raising
once in 500 calls. No hung stream, no leaked block, outcomes that add up, no more failures than faults,
RSS flat after the warm-up.

The 10,000-request soak (~40 s on 2 cores) is marked `soak`: `make test` and CI run it, the fast lane
(`-m "not real_model and not soak"`) runs the same soak over a few hundred requests instead."""

from __future__ import annotations

import logging

import pytest

from metrale import AsyncEngine, EngineConfig
from metrale.bench.chaos import ChaosSettings, chaos_soak
from metrale.failpoints import POINTS

pytestmark = pytest.mark.timeout(600)


async def soak(model: str, settings: ChaosSettings) -> dict:
    failpoints = ",".join(f"{p}=0.002" for p in POINTS if p != "tokenize")  # token-id prompts: no tokenizing
    config = EngineConfig(model=model, kv_cache_bytes=4 << 20, block_size=4, max_num_seqs=64,
                          max_num_batched_tokens=512, failpoints=failpoints)
    async with AsyncEngine(config) as engine:
        result = await chaos_soak(engine, settings)
    print(result)
    assert result["verdict"] == "PASS", result["reasons"]
    return result


@pytest.mark.soak
async def test_ten_thousand_requests_with_cancellations_and_faults(tiny_model, caplog):
    caplog.set_level(logging.CRITICAL, logger="metrale")  # pytest keeps every record: RSS would grow with them
    result = await soak(tiny_model, ChaosSettings(num_requests=10_000, concurrency=64, warmup_requests=2500))
    outcomes = result["outcomes"]
    assert outcomes.get("cancelled", 0) + outcomes.get("abort", 0) > 1000  # the early endings happened
    assert sum(result["failpoints_fired"].values()) > 0


async def test_a_short_soak_with_cancellations_and_faults(tiny_model, caplog):
    caplog.set_level(logging.CRITICAL, logger="metrale")
    result = await soak(tiny_model, ChaosSettings(num_requests=400, concurrency=64, warmup_requests=100,
                                                  cancel_fraction=0.5))
    outcomes = result["outcomes"]
    assert outcomes.get("cancelled", 0) + outcomes.get("abort", 0) > 50  # the early endings happened
