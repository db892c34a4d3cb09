"""`metrale demo`: the default model under real concurrent load, one stream shown live, then a summary."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from metrale.config import EngineConfig
from metrale.engine.async_engine import AsyncEngine
from metrale.sampling_params import SamplingParams

QUESTIONS = (
    "What is the capital of France?", "Give me three tips for learning to cook.",
    "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "What is a prime number?", "Why is the sky blue?", "Name three planets of the solar system.",
    "How do I boil an egg?", "What does a CPU do?", "Suggest a name for a grey cat.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.",
    "How many days are in a leap year?", "What is machine learning?", "Translate 'good morning' to Spanish.",
    "What is the largest ocean on Earth?",
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def _one(engine: AsyncEngine, index: int, params: SamplingParams, show: bool, log: dict) -> None:
    question = QUESTIONS[index % len(QUESTIONS)]
    start = time.perf_counter()
    stamps: list[float] = []
    if show:
        print(f"\n[request {index}] user: {question}\n[request {index}] assistant: ", end="", flush=True)
    async for out in engine.chat([{"role": "user", "content": question}], params):
        stamps.extend([time.perf_counter()] * len(out.token_ids))  # a merged delta: its tokens arrived now
        if show:
            print(out.text, end="", flush=True)
        if out.finish_reason is not None:
            log.setdefault("finish", []).append(out.finish_reason)
    if show:
        print(f"\n[request {index}] done\n", flush=True)
    if stamps:
        log.setdefault("ttft", []).append(stamps[0] - start)
        log.setdefault("itl", []).extend(b - a for a, b in zip(stamps, stamps[1:]) if b > a)
        log.setdefault("tokens", []).append(len(stamps))


async def run_demo(num_requests: int, max_tokens: int, model: str | None) -> int:
    config = EngineConfig(model=model)
    print(f"[metrale] loading {model or 'the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)'} ...", flush=True)
    t0 = time.perf_counter()
    async with AsyncEngine(config) as engine:
        stats = engine.stats()
        print(f"[metrale] loaded in {time.perf_counter() - t0:.1f} s: {stats.kv_blocks_total} KV blocks "
              f"x {config.block_size} tokens, max {config.max_num_seqs} sequences per step", flush=True)
        print(f"[metrale] {num_requests} concurrent chat requests, max_tokens={max_tokens}; request 0 streams below",
              flush=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        log: dict = {}
        start = time.perf_counter()
        await asyncio.gather(*(_one(engine, i, params, i == 0, log) for i in range(num_requests)))
        wall = time.perf_counter() - start
        stats = engine.stats()
        engine.check_integrity()
    tokens = sum(log.get("tokens", []))
    ttft, itl = log.get("ttft", []), log.get("itl", [])
    finishes = {r: log.get("finish", []).count(r) for r in sorted(set(log.get("finish", [])))}
    print("=" * 64)
    print(f" requests            {num_requests} ({', '.join(f'{k}: {v}' for k, v in finishes.items())})")
    print(f" wall time           {wall:.2f} s")
    print(f" output tokens       {tokens} ({tokens / wall:.1f} tok/s)")
    print(f" TTFT p50 / p99      {percentile(ttft, 50) * 1e3:.0f} / {percentile(ttft, 99) * 1e3:.0f} ms")
    print(f" ITL  p50 / p99      {percentile(itl, 50) * 1e3:.0f} / {percentile(itl, 99) * 1e3:.0f} ms"
          f"  (mean {statistics.fmean(itl) * 1e3 if itl else float('nan'):.0f} ms)")
    print(f" peak KV usage       {stats.peak_kv_usage * 100:.1f}% of {stats.kv_blocks_total} blocks")
    print(f" preemptions         {stats.num_preemptions}")
    print(f" KV blocks free      {stats.kv_blocks_free}/{stats.kv_blocks_total} after the run (integrity ok)")
    print("=" * 64)
    return 0


def main(args) -> int:
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    return runner(run_demo(args.requests, args.max_tokens, args.model))


if __name__ == "__main__":
    sys.exit(asyncio.run(run_demo(32, 128, None)))
