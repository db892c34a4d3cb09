"""Prompt processing (TTFT of one long prompt) per kernel set and activation precision, alternating in one run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/prompt_isa_bench.py --model /tmp/metrale-shapes/llama-1b-q4_0.gguf
    ... --variants avx512/int16 avx512_amx/int16 avx512_amx/int12 avx512_amx/auto --rounds 3 --prompt-len 512

Each variant is a fresh process (`--worker`) with METRALE_CPU_ISA and METRALE_QMM_ACTIVATIONS set from its
name (isa/precision); it loads the GGUF into an AsyncEngine (in process, metrale's load generator), warms up,
then times --prompts prompts of --prompt-len random token ids (a different seed each, so no prefix is cached)
with one output token: TTFT. Variants run alternately, round after round, and the median TTFT per variant is
reported: the machine is shared, so load hits every variant alike. The GGUFs: benchmarks/gguf_shapes_bench.py
--write-only writes the 1B-shaped one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


async def worker(model: str, prompt_len: int, prompts: int, vocab: int) -> list[float]:
    from metrale import AsyncEngine, EngineConfig
    from metrale.bench.loadgen import run_benchmark
    from metrale.bench.targets import EngineTarget
    from metrale.bench.workloads import random_requests

    async with AsyncEngine(EngineConfig(model=model, max_num_seqs=4)) as engine:
        target = EngineTarget(engine)
        await run_benchmark(target, random_requests(1, 64, 2, seed=99, vocab_size=vocab), show_progress=False)
        ttfts = []
        for i in range(prompts):
            request = random_requests(1, prompt_len, 1, seed=1000 + i, vocab_size=vocab)
            r = await run_benchmark(target, request, show_progress=False)
            ttfts.append(r["mean_ttft_ms"] / 1e3)
        return ttfts


def run_variant(variant: str, args: argparse.Namespace) -> list[float]:
    isa, precision = variant.split("/")
    env = dict(os.environ, METRALE_CPU_ISA=isa, METRALE_QMM_ACTIVATIONS=precision)
    cmd = [sys.executable, str(HERE), "--worker", "--model", args.model, "--prompt-len", str(args.prompt_len),
           "--prompts", str(args.prompts), "--vocab", str(args.vocab)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} exited {out.returncode}:\n{out.stdout[-500:]}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/metrale-shapes/llama-1b-q4_0.gguf")
    p.add_argument("--variants", nargs="+", default=["avx512/int16", "avx512/int12", "avx512_amx/int16",
                                                     "avx512_amx/int12"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="timed prompts per variant and round")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--vocab", type=int, default=128256, help="random ids are drawn below this")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= 100 or not 1 <= args.rounds <= 100 or not 1 <= args.prompt_len <= 32768:
        p.error("--prompts and --rounds must be 1..100, --prompt-len 1..32768")
    if args.worker:
        print(json.dumps(asyncio.run(worker(args.model, args.prompt_len, args.prompts, args.vocab))))
        return
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    for round_ in range(args.rounds):
        for variant in args.variants:
            got = run_variant(variant, args)
            times[variant].extend(got)
            print(f"# round {round_ + 1} {variant}: TTFT {', '.join(f'{t:.2f}' for t in got)} s", file=sys.stderr,
                  flush=True)
    base = statistics.median(times[args.variants[0]])
    print(f"| variant | median TTFT, {args.prompt_len} tokens (s) | prompt tok/s | vs {args.variants[0]} |")
    print("|---|---:|---:|---:|")
    for variant, ts in times.items():
        med = statistics.median(ts)
        print(f"| {variant} | {med:.2f} | {args.prompt_len / med:.0f} | {base / med:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "prompt_len": args.prompt_len, "ttft_s": times}))


if __name__ == "__main__":
    main()
