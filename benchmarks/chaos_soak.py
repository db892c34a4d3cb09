"""The chaos soak on the real default model (the long variant of tests/metrale/engine/test_soak.py).

    .venv/bin/python benchmarks/chaos_soak.py --requests 2000 [--failpoint-rate 0.002] [--json out.json]

Requests ended early five ways (aclose, break, an exception in the consumer, task cancel,
engine.abort), every failpoint armed at the given rate; prints the outcome counts, the faults that
fired, RSS after the warm-up and at the end, and the verdict (metrale.bench.chaos).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale import AsyncEngine, EngineConfig  # noqa: E402
from metrale.bench.chaos import ChaosSettings, chaos_soak  # noqa: E402
from metrale.failpoints import POINTS  # noqa: E402


async def main(args: argparse.Namespace) -> int:
    failpoints = ",".join(f"{p}={args.failpoint_rate}" for p in POINTS if p != "tokenize")
    config = EngineConfig(kv_cache_bytes=256 << 20, max_num_seqs=args.concurrency, failpoints=failpoints)
    settings = ChaosSettings(num_requests=args.requests, concurrency=args.concurrency,
                             warmup_requests=args.requests // 4, input_len=(8, 96), output_len=(1, 24),
                             hang_timeout_s=300.0)
    async with AsyncEngine(config) as engine:
        result = await chaos_soak(engine, settings)
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--failpoint-rate", type=float, default=0.002)
    parser.add_argument("--json", default=None)
    logging.basicConfig(level=logging.CRITICAL)
    sys.exit(asyncio.run(main(parser.parse_args())))
