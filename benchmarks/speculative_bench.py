"""Speculative decoding on vs off, on the default model: output tok/s and acceptance, 1/8/32 streams.

    .venv/bin/python benchmarks/speculative_bench.py [--streams 1 8 32] [--output-len 96] [--k 4]

Two workloads, greedy:
  grounded  chat requests that ask the model to copy a given passage with small edits (outputs copy
            from the prompt: what prompt-lookup speculation is for)
  random    random-token prompts with ignore_eos (nothing to look up)
and three engines: speculation off; n-gram speculation with the default policy (it turns itself off
above `disable_by_batch_size` running requests); n-gram forced on at every batch size. The engines
run one after another in one process; each level runs after a warm-up. Writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

from metrale import AsyncEngine, EngineConfig, SamplingParams

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens, and wrote the weather in a small leather book. Ships passed far out on the grey water, "
    "and none of their sailors knew his name, yet every one of them trusted his light. In winter the wind "
    "howled against the glass, and in summer the gulls circled the tower from dawn until dark."
)
TASKS = ("Copy this text exactly, changing 'lighthouse' to 'beacon':", "Repeat the following passage word for word:",
         "Rewrite this text in the past perfect tense, keeping every sentence:", "Copy the text below exactly:")


def grounded_requests(n: int) -> list:
    return [[{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{PASSAGE}"}] for i in range(n)]


def random_requests(n: int, vocab: int, length: int, seed: int) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def counters(engine: AsyncEngine) -> tuple[float, float]:
    labels = {"model_name": engine.metrics.model_name}
    get = engine.registry.get_sample_value
    return (get("metrale_spec_decode_num_draft_tokens_total", labels) or 0.0,
            get("metrale_spec_decode_num_accepted_tokens_total", labels) or 0.0)


async def level(engine: AsyncEngine, workload: str, streams: int, output_len: int) -> dict:
    if workload == "grounded":
        params = SamplingParams(max_tokens=output_len, temperature=0)
        submit = [lambda m=m: engine.chat(m, params) for m in grounded_requests(streams)]
    else:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        submit = [lambda p=p: engine.generate(p, params) for p in random_requests(streams, engine.vocab_size, 128, streams)]
    drafts0, accepted0 = counters(engine)

    async def one(make) -> int:
        return sum([len(out.token_ids) async for out in make()])

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(m) for m in submit)))
    wall = time.perf_counter() - start
    drafts, accepted = (a - b for a, b in zip(counters(engine), (drafts0, accepted0)))
    return {"workload": workload, "streams": streams, "output_tokens": tokens, "wall_s": round(wall, 2),
            "output_tok_per_s": round(tokens / wall, 1), "draft_tokens": int(drafts),
            "acceptance_rate": round(accepted / drafts, 3) if drafts else None}


async def run_engine(name: str, spec: dict | None, args: argparse.Namespace) -> list[dict]:
    config = EngineConfig(max_num_seqs=max(args.streams), speculative_config=spec)
    rows = []
    async with AsyncEngine(config) as engine:
        await engine.complete("warm up", SamplingParams(max_tokens=8, ignore_eos=True))
        for workload in args.workloads:
            for streams in args.streams:
                row = {"engine": name, **await level(engine, workload, streams, args.output_len)}
                rows.append(row)
                print(f"{name:14s} {workload:8s} {streams:3d} streams: {row['output_tok_per_s']:7.1f} tok/s  "
                      f"acceptance {row['acceptance_rate']}", flush=True)
    return rows


async def main(args: argparse.Namespace) -> list[dict]:
    ngram = {"method": "ngram", "num_speculative_tokens": args.k}
    engines = [("off", None), ("ngram", ngram), ("ngram-forced", {**ngram, "disable_by_batch_size": 1024})]
    rows = []
    for name, spec in engines:
        rows += await run_engine(name, spec, args)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--workloads", nargs="+", default=["grounded", "random"], choices=["grounded", "random"])
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/speculative.json")
    args = parser.parse_args()
    results = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")
