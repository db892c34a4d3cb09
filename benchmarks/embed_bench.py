"""Embedding throughput on the real default model (SmolLM2-135M Q4_1): one input per call against batches.

    .venv/bin/python benchmarks/embed_bench.py --rounds 3 --inputs 16 --tokens 128

One in-process AsyncEngine (its defaults: max_num_batched_tokens 512, last-token pooling). Each round embeds
`--inputs` random token-id inputs of `--tokens` tokens twice, alternating the order of the two forms round
after round so that load on a shared machine hits both alike:
    batch 1    one `engine.embed([x])` call after the other (each input alone in its steps)
    batch N    one `engine.embed([x1..xN])` call (the inputs batched through the scheduler)
It reports embeddings/s and prompt tokens/s per form (the median round, and every round) as JSON on stdout.
A warm-up call runs first. Inputs differ per round and per form (the engine reads no prefix cache for
embeddings anyway).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time


async def run(rounds: int, num_inputs: int, num_tokens: int, max_num_batched_tokens: int, seed: int) -> dict:
    from metrale import AsyncEngine, EngineConfig

    rng = random.Random(seed)

    def inputs() -> list[list[int]]:
        return [[rng.randrange(100, 40_000) for _ in range(num_tokens)] for _ in range(num_inputs)]

    times: dict[str, list[float]] = {"batch 1": [], f"batch {num_inputs}": []}
    async with AsyncEngine(EngineConfig(max_num_batched_tokens=max_num_batched_tokens)) as engine:
        await engine.embed(inputs()[:2])  # warm-up
        for index in range(rounds):
            forms = list(times) if index % 2 == 0 else list(reversed(times))
            for form in forms:
                batch = inputs()
                started = time.perf_counter()
                if form == "batch 1":
                    for one in batch:
                        await engine.embed([one])
                else:
                    await engine.embed(batch)
                times[form].append(time.perf_counter() - started)
    report = {"model": "SmolLM2-135M-Instruct Q4_1 (default)", "inputs": num_inputs, "tokens_per_input": num_tokens,
              "max_num_batched_tokens": max_num_batched_tokens, "rounds": rounds, "forms": {}}
    for form, seconds in times.items():
        median = statistics.median(seconds)
        report["forms"][form] = {"embeddings_per_s": round(num_inputs / median, 2),
                                 "tokens_per_s": round(num_inputs * num_tokens / median, 1),
                                 "seconds_per_round": [round(s, 3) for s in seconds]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inputs", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report = asyncio.run(run(args.rounds, args.inputs, args.tokens, args.max_num_batched_tokens, args.seed))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
