"""Output throughput of the in-process engine at several concurrencies (ignore_eos, fixed lengths).

    .venv/bin/python benchmarks/throughput.py --concurrency 1 8 32 --prompt-len 128 --output-len 128

Every stream gets a distinct random prompt of exactly --prompt-len tokens (no prefix-cache help),
all submitted at once; a warm-up request runs first. Prints one row per concurrency and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import time
from pathlib import Path

from metrale import AsyncEngine, EngineConfig, SamplingParams


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


async def run_level(engine: AsyncEngine, concurrency: int, prompt_len: int, output_len: int, seed: int) -> dict:
    vocab = engine.vocab_size
    prompts = random_prompts(concurrency, prompt_len, vocab, seed + concurrency)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ttfts: list[float] = []

    async def one(prompt: list[int]) -> int:
        start = time.perf_counter()
        n = 0
        async for out in engine.generate(prompt, params):
            if n == 0 and out.token_ids:
                ttfts.append(time.perf_counter() - start)
            n += len(out.token_ids)
        return n

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    engine.check_integrity()
    total = sum(counts)
    return {"concurrency": concurrency, "output_tokens": total, "wall_s": round(wall, 3),
            "output_tok_per_s": round(total / wall, 2),
            "mean_ttft_s": round(sum(ttfts) / len(ttfts), 3),
            "per_stream_tok_per_s": round(total / wall / concurrency, 2)}


async def main(args: argparse.Namespace) -> list[dict]:
    config = EngineConfig(model=args.model, max_num_seqs=max(args.concurrency),
                          max_num_batched_tokens=args.max_num_batched_tokens)
    async with AsyncEngine(config) as engine:
        await engine.complete("warm up", SamplingParams(max_tokens=4, ignore_eos=True))
        rows = []
        for c in args.concurrency:
            row = await run_level(engine, c, args.prompt_len, args.output_len, args.seed)
            rows.append(row)
            print(f"concurrency {c:3d}: {row['output_tok_per_s']:7.1f} output tok/s  "
                  f"({row['output_tokens']} tokens in {row['wall_s']:.1f} s, mean TTFT {row['mean_ttft_s']:.2f} s)",
                  flush=True)
    base = rows[0]["output_tok_per_s"]
    for row in rows:
        row["speedup_vs_first"] = round(row["output_tok_per_s"] / base, 2)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args()
    rows = asyncio.run(main(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "results": rows}, indent=2))
    print(f"wrote {args.out}")
