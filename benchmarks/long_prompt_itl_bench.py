"""Do running streams keep their pace while a long prompt is processed? ITL before/while, and its TTFT.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/long_prompt_itl_bench.py --max-step-ms none 60 --rounds 2

Each variant (a value of max_step_ms; "none" is off) is a fresh process (`--worker`) with the default
model (SmolLM2-135M Q4_1) in process. It starts `--streams` streams (short random prompts, ignore_eos),
records their inter-token gaps for `--baseline-tokens` tokens each, then submits one random prompt of
`--prompt-len` tokens (max_tokens=1) and records the streams' gaps until that prompt's first token (its
TTFT). Then it aborts the streams. A gap is the time between two deltas of a stream divided by the
tokens the second delta carries. Variants run alternately, round after round; the median per variant
is reported (the machine is shared, so load hits every variant alike).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(max_step_ms: float | None, min_prefill_chunk: int, streams: int, prompt_len: int,
                  baseline_tokens: int, seed: int) -> dict:
    from metrale import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(max_num_seqs=max(8, streams + 1), max_step_ms=max_step_ms, min_prefill_chunk=min_prefill_chunk,
                          max_model_len=prompt_len + 1)
    rng = random.Random(seed)
    async with AsyncEngine(config) as engine:
        await engine.complete([rng.randrange(100, 4000) for _ in range(600)], SamplingParams(max_tokens=4))
        gaps: list[list[tuple[float, float]]] = [[] for _ in range(streams)]  # (time of delta, gap per token)
        long_submitted = asyncio.Event()
        params = SamplingParams(max_tokens=prompt_len + 1 - 16, ignore_eos=True, temperature=0)

        async def stream(i: int) -> None:
            last = None
            async for out in engine.generate([rng.randrange(100, 4000) for _ in range(16)], params,
                                             request_id=f"s{i}"):
                now = time.perf_counter()
                if last is not None and out.token_ids:
                    gaps[i].append((now, (now - last) / len(out.token_ids)))
                if out.token_ids:
                    last = now

        tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
        while min(len(g) for g in gaps) < baseline_tokens:
            await asyncio.sleep(0.05)
        submitted = time.perf_counter()
        long_prompt = [rng.randrange(100, 4000) for _ in range(prompt_len)]
        async for out in engine.generate(long_prompt, SamplingParams(max_tokens=1)):
            if out.token_ids:
                break
        first_token = time.perf_counter()
        for i in range(streams):
            engine.abort(f"s{i}")
        await asyncio.gather(*tasks)
    before = [gap for g in gaps for t, gap in g[2:] if t < submitted]  # the first gaps include warm-up
    during = [gap for g in gaps for t, gap in g if submitted < t <= first_token]
    return {"itl_before_p50_ms": 1e3 * statistics.median(before), "itl_before_p99_ms": 1e3 * percentile(before, 0.99),
            "itl_during_p50_ms": 1e3 * statistics.median(during), "itl_during_p99_ms": 1e3 * percentile(during, 0.99),
            "itl_during_max_ms": 1e3 * max(during), "long_ttft_s": first_token - submitted,
            "tokens_during": len(during)}


def run_variant(max_step_ms: str, args) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", "--max-step-ms", max_step_ms, "--streams", str(args.streams),
           "--min-prefill-chunk", str(args.min_prefill_chunk),
           "--prompt-len", str(args.prompt_len), "--baseline-tokens", str(args.baseline_tokens)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-step-ms", nargs="+", default=["none", "60"], help="variants; 'none' is off")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--min-prefill-chunk", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--baseline-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, help="write every round's numbers as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        (value,) = args.max_step_ms
        result = asyncio.run(measure(None if value == "none" else float(value), args.min_prefill_chunk, args.streams, args.prompt_len,
                                     args.baseline_tokens, seed=0))
        print("RESULT " + json.dumps(result), flush=True)
        return
    runs: dict[str, list[dict]] = {v: [] for v in args.max_step_ms}
    for r in range(args.rounds):
        for variant in args.max_step_ms:
            runs[variant].append(run_variant(variant, args))
            print(f"round {r + 1} max_step_ms={variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)
    keys = list(next(iter(runs.values()))[0])
    print(f"median of {args.rounds} alternating rounds; {args.streams} streams, one {args.prompt_len}-token prompt")
    print(f"{'max_step_ms':>11s} " + " ".join(f"{k:>18s}" for k in keys))
    for variant, rs in runs.items():
        print(f"{variant:>11s} " + " ".join(f"{statistics.median(x[k] for x in rs):18.1f}" for k in keys))
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
