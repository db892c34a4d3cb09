"""The chaos soak on a tiny model (issue #11): 10,000 requests, 20% ended early five ways, every
failpoint raising once in 500 calls. No hung stream, no leaked block, outcomes that add up, no more
failures than faults, RSS flat after the warm-up."""

from __future__ import annotations

import logging

import pytest

from metrale import AsyncEngine, EngineConfig
from metrale.bench.chaos import ChaosSettings, chaos_soak
from metrale.failpoints import POINTS

pytestmark = pytest.mark.timeout(600)


async def test_ten_thousand_requests_with_cancellations_and_faults(tiny_model, caplog):
    caplog.set_level(logging.CRITICAL, logger="metrale")  # pytest keeps every record: RSS would grow with them
    failpoints = ",".join(f"{p}=0.002" for p in POINTS if p != "tokenize")  # token-id prompts: no tokenizing
    config = EngineConfig(model=tiny_model, kv_cache_bytes=4 << 20, block_size=4, max_num_seqs=64,
                          max_num_batched_tokens=512, failpoints=failpoints)
    async with AsyncEngine(config) as engine:
        result = await chaos_soak(engine, ChaosSettings(num_requests=10_000, concurrency=64, warmup_requests=2500))
    print(result)
    assert result["verdict"] == "PASS", result["reasons"]
    outcomes = result["outcomes"]
    assert outcomes.get("cancelled", 0) + outcomes.get("abort", 0) > 1000  # the early endings happened
    assert sum(result["failpoints_fired"].values()) > 0
