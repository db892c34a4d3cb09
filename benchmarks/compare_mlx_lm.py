"""metrale next to mlx-lm's BatchGenerator: same weights, same workloads, alternating rounds, ratios.

    .venv/bin/python benchmarks/compare_mlx_lm.py                     # the full run (~12 min on 2 CPU cores)
    .venv/bin/python benchmarks/compare_mlx_lm.py --rounds 1 --poisson-requests 12 --sweep   # shorter

mlx-lm gets metrale's loaded weights (the default model, dequantized to float32 on CPU) in its own
llama Model, and is driven as mlx-lm's server drives it (metrale.bench.mlx_lm_target). Both run in
this process, one at a time: while one runs the other is idle. Workloads:
  (a) throughput: --streams concurrent streams, prompt --prompt-len, output --output-len,
      ignore_eos, all at once; rounds alternate metrale, mlx-lm, metrale, mlx-lm, ...
  (b) latency: Poisson arrivals at --load-fraction of metrale's capacity measured in (a) (its
      request throughput), the same trace (arrival times and prompts) for both; TTFT and ITL p99.
  --sweep (1, 8 streams) adds points for the throughput-vs-concurrency plot.
Every round gets fresh prompts (no prefix-cache help across rounds); both engines get the same
ones. Writes JSON, a markdown table and PNG plots under --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import statistics
from pathlib import Path
from typing import Any

from metrale import AsyncEngine, EngineConfig
from metrale.engine.startup import RunnerKeeper
from metrale.bench.loadgen import BenchSettings, run_benchmark
from metrale.bench.mlx_lm_target import MlxLmTarget, mlx_lm_model
from metrale.bench.report import format_result, write_json
from metrale.bench.targets import EngineTarget
from metrale.bench.workloads import random_requests

PERCENTILES = (50.0, 90.0, 99.0)
TARGET_TPUT = "a: output throughput >= 1.5x mlx-lm"
TARGET_TTFT = "b: TTFT p99 <= 0.5x mlx-lm"
TARGET_ITL = "b: ITL p99 below mlx-lm's"


async def first_tokens(target: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy output token ids of each prompt, one request at a time."""
    from metrale.bench.workloads import BenchRequest

    outputs = []
    for prompt in prompts:
        ids: list[int] = []
        async for chunk in target.stream(BenchRequest(prompt_len=len(prompt), output_len=n, prompt=prompt)):
            ids.extend(chunk.token_ids)
        outputs.append(ids)
    return outputs


async def same_tokens_check(targets: list[Any], vocab: int, n: int = 24) -> dict[str, Any]:
    """Do both engines generate the same greedy tokens from the same weights? (the honesty check)"""
    prompts = [r.prompt for r in random_requests(4, 64, n, seed=7, vocab_size=vocab)]
    a, b = [await first_tokens(t, prompts, n) for t in targets]
    common = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return {"prompts": len(prompts), "tokens": n, "identical": sum(c == n for c in common),
            "common_prefix_tokens": common}


async def run_round(targets: list[Any], requests: list, settings: BenchSettings, label: str) -> list[dict]:
    """The same requests on each target in turn; one result per target."""
    results = []
    for target in targets:
        result = await run_benchmark(target, requests, settings, label=f"{label} {target.name}",
                                     percentiles=PERCENTILES, extra={"workload": label})
        print(format_result(result, title=f"{label}: {target.name}"), flush=True)
        results.append(result)
    return results


async def throughput_rounds(targets: list[Any], args: argparse.Namespace, vocab: int) -> list[list[dict]]:
    rounds = []
    for i in range(args.rounds):
        requests = random_requests(args.streams, args.prompt_len, args.output_len, seed=1000 + i, vocab_size=vocab)
        rounds.append(await run_round(targets, requests, BenchSettings(max_concurrency=args.streams),
                                      f"(a) round {i + 1}"))
    return rounds


async def latency_rounds(targets: list[Any], args: argparse.Namespace, vocab: int, rate: float) -> list[list[dict]]:
    rounds = []
    for i in range(args.poisson_rounds):
        requests = random_requests(args.poisson_requests, args.prompt_len, args.output_len, seed=2000 + i,
                                   vocab_size=vocab)
        settings = BenchSettings(request_rate=rate, seed=i)
        rounds.append(await run_round(targets, requests, settings, f"(b) round {i + 1}"))
    return rounds


async def sweep_rounds(targets: list[Any], args: argparse.Namespace, vocab: int) -> list[list[dict]]:
    rounds = []
    for streams in (1, 8):
        requests = random_requests(streams, args.prompt_len, args.output_len, seed=3000 + streams, vocab_size=vocab)
        rounds.append(await run_round(targets, requests, BenchSettings(max_concurrency=streams),
                                      f"sweep {streams} streams"))
    return rounds


def ratio(rounds: list[list[dict]], key: str) -> dict[str, Any]:
    """metrale / mlx-lm of `key` per round, and their median."""
    per_round = [m[key] / x[key] if x[key] else float("inf") for m, x in rounds]
    return {"metrale": [m[key] for m, _ in rounds], "mlx_lm": [x[key] for _, x in rounds],
            "ratio_per_round": per_round, "ratio_median": statistics.median(per_round)}


def summarize(a: list[list[dict]], b: list[list[dict]], rate: float) -> dict[str, Any]:
    """Ratios and target verdicts; (b)'s only when it ran."""
    tput = ratio(a, "output_throughput")
    summary: dict[str, Any] = {"a_output_throughput": tput, "targets": {TARGET_TPUT: tput["ratio_median"] >= 1.5}}
    if b:
        ttft, itl = ratio(b, "p99_ttft_ms"), ratio(b, "p99_itl_ms")
        summary.update({"b_request_rate": rate, "b_p99_ttft_ms": ttft, "b_p99_itl_ms": itl})
        summary["targets"].update({TARGET_TTFT: ttft["ratio_median"] <= 0.5, TARGET_ITL: itl["ratio_median"] < 1.0})
    return summary


def markdown(summary: dict[str, Any], args: argparse.Namespace, load: list[float]) -> str:
    """The README table."""
    med = statistics.median
    ok = {k: "met" if v else "missed" for k, v in summary["targets"].items()}
    t = summary["a_output_throughput"]
    rows = [
        "| workload | metric | metrale | mlx-lm | metrale / mlx-lm | target |",
        "|---|---|---:|---:|---:|---|",
        f"| (a) {args.streams} streams, prompt {args.prompt_len}, output {args.output_len}, ignore_eos | output tok/s "
        f"| {med(t['metrale']):.1f} | {med(t['mlx_lm']):.1f} | {t['ratio_median']:.2f}x | >= 1.5x {ok[TARGET_TPUT]} |",
    ]
    if "b_p99_ttft_ms" in summary:
        f, i = summary["b_p99_ttft_ms"], summary["b_p99_itl_ms"]
        rows += [
            f"| (b) Poisson {summary['b_request_rate']:.3f} req/s ({args.load_fraction:.0%} of metrale's capacity), "
            f"{args.poisson_requests} requests | TTFT p99 (ms) | {med(f['metrale']):.0f} | {med(f['mlx_lm']):.0f} "
            f"| {f['ratio_median']:.2f}x | <= 0.5x {ok[TARGET_TTFT]} |",
            f"| (b) same trace | ITL p99 (ms) | {med(i['metrale']):.0f} | {med(i['mlx_lm']):.0f} "
            f"| {i['ratio_median']:.2f}x | < 1x {ok[TARGET_ITL]} |",
        ]
    note = (f"\nDefault model (SmolLM2-135M-Instruct) in float32 on {os.cpu_count()} CPU cores, both engines in one "
            f"process on the same weights, alternating; medians of {args.rounds} (a) and {args.poisson_rounds} (b) "
            f"rounds; 1-min load average {min(load):.1f}-{max(load):.1f} during the runs (a shared machine).")
    return "\n".join(rows) + "\n" + note + "\n"


def plots(out_dir: Path, stem: str, a: list[list[dict]], b: list[list[dict]], sweep: list[list[dict]]) -> list[Path]:
    """Throughput vs concurrency (the sweep points and the median-low (a) round) and (b)'s latency CDFs."""
    from metrale.bench.plots import plot_latency_cdfs, plot_throughput

    series = {}
    for k, name in enumerate(("metrale", "mlx-lm")):
        a_runs = sorted((rnd[k] for rnd in a), key=lambda r: r["output_throughput"])
        series[name] = [rnd[k] for rnd in sweep] + [a_runs[(len(a_runs) - 1) // 2]]
    paths = [plot_throughput(series, out_dir / f"{stem}_throughput.png",
                             title="output throughput vs concurrency (random prompts, ignore_eos)")]
    if b:
        paths.append(plot_latency_cdfs({"metrale": b[0][0], "mlx-lm": b[0][1]}, out_dir / f"{stem}_latency.png",
                                       title="(b) Poisson arrivals, same trace: latency CDFs"))
    return paths


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(max_num_seqs=args.streams, max_num_batched_tokens=args.max_num_batched_tokens)
    keeper = RunnerKeeper()
    async with AsyncEngine(config, runner_factory=keeper) as engine:
        runner = keeper.runner
        vocab = runner.model_config.vocab_size
        factory = functools.partial(mlx_lm_model, runner.model_config, runner.model)
        async with MlxLmTarget(factory, completion_batch_size=args.streams) as mlx_target:
            targets = [EngineTarget(engine), mlx_target]
            warm = random_requests(8, args.prompt_len, 8, seed=99, vocab_size=vocab)
            for target in targets:
                await run_benchmark(target, warm, show_progress=False)
            check = await same_tokens_check(targets, vocab)
            print(f"same weights check: {check}", flush=True)
            sweep = await sweep_rounds(targets, args, vocab) if args.sweep else []
            a = await throughput_rounds(targets, args, vocab)
            capacity = statistics.median(r[0]["request_throughput"] for r in a)
            b = await latency_rounds(targets, args, vocab, args.load_fraction * capacity)
            engine.check_integrity()
    return {"same_tokens_check": check, "capacity_req_per_s": capacity, "sweep": sweep, "a": a, "b": b,
            "summary": summarize(a, b, args.load_fraction * capacity)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="(a) rounds per engine")
    parser.add_argument("--poisson-requests", type=int, default=32)
    parser.add_argument("--poisson-rounds", type=int, default=1, help="0 skips (b)")
    parser.add_argument("--load-fraction", type=float, default=0.8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--sweep", action="store_true", help="also 1 and 8 streams, for the concurrency plot")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default="compare_mlx_lm", help="file stem of the JSON, table and plots")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    result = asyncio.run(main(args))
    loads = [v for rnd in result["a"] + result["b"] + result["sweep"] for r in rnd for v in r["load_average_1m"]]
    table = markdown(result["summary"], args, loads)
    print(table)
    out = Path(args.out_dir)
    meta = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "args": vars(args)}
    print(f"wrote {write_json(out / f'{args.name}.json', [result], meta)}")
    (out / f"{args.name}.md").write_text(table)
    for path in plots(out, args.name, result["a"], result["b"], result["sweep"]):
        print(f"wrote {path}")
