"""`metrale bench`: load-test the in-process engine or an OpenAI-compatible server.

`metrale.cli` adds the subcommand with `add_bench_parser(subparsers)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, AsyncIterator

DESCRIPTION = """Load-test metrale in process, or any OpenAI-compatible server with --base-url.

    metrale bench --num-prompts 32 --max-concurrency 32 --random-input-len 128 --random-output-len 128
    metrale bench --base-url http://127.0.0.1:8000 --request-rate 0.5 --burstiness 0.5
    metrale bench --max-concurrency 1 8 32          # a sweep: one run per value, plus a throughput plot
    metrale bench --dataset chat --chat-system-len 300
    metrale bench --request-rate 1 --goodput ttft:500 tpot:100   # + requests meeting both SLOs
    metrale bench --dataset sharegpt --dataset-path ShareGPT_V3_unfiltered_cleaned_split.json
    metrale bench --dataset prefix_repetition --prefix-repetition-num-prefixes 4   # the prefix cache at work
    metrale bench --dataset custom --dataset-path prompts.jsonl      # {"prompt": ..., "output_tokens": N} lines
    metrale bench --duration 120 --max-concurrency 8                # stop sending after 120 s
    metrale bench --ramp-up-strategy linear --ramp-up-start-rps 0.5 --ramp-up-end-rps 8 --num-prompts 200
    metrale bench --compare http://127.0.0.1:8000 http://127.0.0.1:8080   # two servers, alternating, B/A ratios
    metrale bench --soak --soak-duration 600 --request-rate 1   # 20% cancelled, RSS + KV blocks, PASS/FAIL

Each run draws fresh prompts (a new --seed, printed) so that a second run does not measure a warm prefix
cache; give --seed to repeat one, and the summary says how many prompt tokens the server took from its cache.
Arrivals as in vLLM bench: --request-rate inf sends all at once, otherwise gamma gaps with shape
--burstiness (1 = Poisson); --max-concurrency caps requests in flight. Results: a console table, a
JSON file with vLLM's field names and PNG plots under --result-dir.
"""


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand; its `func` default runs it and returns the exit code."""
    parser = subparsers.add_parser("bench", help="load-test the engine or an OpenAI-compatible server",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    parser.set_defaults(func=run_bench)
    return parser


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench flags: target, workload, arrivals, output, soak."""
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="an OpenAI-compatible server (default: the engine in process)")
    target.add_argument("--compare", nargs=2, default=None, metavar=("URL_A", "URL_B"),
                        help="two OpenAI-compatible servers: every setting runs on A then B, then a table of B / A")
    target.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    target.add_argument("--api-key", default=None)
    target.add_argument("--model", default=None, help="in process: GGUF file or model folder (default model)")
    target.add_argument("--max-num-seqs", type=int, default=None,
                        help="in process (default: the largest --max-concurrency, at least 64)")
    target.add_argument("--max-num-batched-tokens", type=int, default=512)
    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", choices=("random", "chat", "prefix_repetition", "sharegpt", "custom"),
                      default="random")
    work.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file, or the custom JSONL file")
    work.add_argument("--num-prompts", type=int, default=32)
    work.add_argument("--random-input-len", type=int, default=128)
    work.add_argument("--random-output-len", type=int, default=128)
    work.add_argument("--random-range-ratio", type=float, default=0.0)
    work.add_argument("--chat-system-len", type=int, default=256, help="words in the shared system prompt")
    work.add_argument("--chat-user-len", type=int, default=32, help="words in each user message")
    work.add_argument("--sharegpt-output-len", type=int, default=None)
    work.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="words in each shared prefix")
    work.add_argument("--prefix-repetition-suffix-len", type=int, default=32, help="words after the prefix")
    work.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    work.add_argument("--seed", type=int, default=None, help="the workload's seed (default: a fresh one per run)")
    load = parser.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf], help="req/s; inf = all at once")
    load.add_argument("--burstiness", type=float, default=1.0)
    load.add_argument("--max-concurrency", type=int, nargs="+", default=[None])
    load.add_argument("--num-warmups", type=int, default=2)
    load.add_argument("--duration", type=float, default=None, help="seconds: stop sending after this long "
                      "(--num-prompts is then the most that can be sent)")
    load.add_argument("--ramp-up-strategy", choices=("linear", "exponential"), default=None,
                      help="the request rate ramps from --ramp-up-start-rps to --ramp-up-end-rps over the run")
    load.add_argument("--ramp-up-start-rps", type=float, default=None)
    load.add_argument("--ramp-up-end-rps", type=float, default=None)
    out = parser.add_argument_group("output")
    out.add_argument("--result-dir", default="bench-results")
    out.add_argument("--result-filename", default=None, help="JSON file name (default: from target and time)")
    out.add_argument("--label", default="")
    out.add_argument("--percentiles", type=float, nargs="+", default=[99.0], help="besides mean/median/std")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs, any of ttft:MS tpot:MS e2el:MS: also report the requests meeting all of them "
                          "(request_goodput in req/s and their share), as vLLM bench's --goodput")
    out.add_argument("--no-save", action="store_true", help="print only")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    soak = parser.add_argument_group("soak (in process)")
    soak.add_argument("--soak", action="store_true", help="the soak run instead of a benchmark")
    soak.add_argument("--soak-duration", type=float, default=180.0, help="seconds")
    soak.add_argument("--soak-cycle", type=float, default=40.0, help="seconds of load between idle checks")
    soak.add_argument("--cancel-fraction", type=float, default=0.2)


def run_bench(args: argparse.Namespace) -> int:
    """Run `metrale bench`; returns the exit code (1 when any request failed or the soak failed)."""
    if args.dataset in ("sharegpt", "custom") and not args.dataset_path:
        print(f"metrale bench: --dataset {args.dataset} needs --dataset-path", file=sys.stderr)
        return 2
    if args.ramp_up_strategy is not None and (args.ramp_up_start_rps is None or args.ramp_up_end_rps is None):
        print("metrale bench: --ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps", file=sys.stderr)
        return 2
    if args.compare and (args.base_url or args.soak):
        print("metrale bench: --compare takes the two servers itself; leave out --base-url and --soak", file=sys.stderr)
        return 2
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**31)
        print(f"metrale bench: workload seed {args.seed} (--seed {args.seed} repeats it)")
    if args.soak and args.base_url:
        print("metrale bench: --soak runs in process; leave out --base-url", file=sys.stderr)
        return 2
    from metrale.bench.stats import GoodputSLOs

    try:
        args.slos = GoodputSLOs.parse(args.goodput) if args.goodput is not None else None
    except ValueError as error:
        print(f"metrale bench: --goodput: {error}", file=sys.stderr)
        return 2
    return asyncio.run(_soak(args) if args.soak else _bench(args))


@contextlib.asynccontextmanager
async def _engine(args: argparse.Namespace, max_num_seqs: int) -> AsyncIterator[Any]:
    from metrale import AsyncEngine, EngineConfig

    config = EngineConfig(model=args.model, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    async with AsyncEngine(config) as engine:
        yield engine


@contextlib.asynccontextmanager
async def open_target(args: argparse.Namespace) -> AsyncIterator[tuple[Any, Any]]:
    """(target, engine or None) for the flags: the in-process engine, or an OpenAITarget."""
    from metrale.bench.targets import EngineTarget, OpenAITarget

    if args.base_url:
        async with OpenAITarget(args.base_url, model=args.served_model, api_key=args.api_key,
                                temperature=args.temperature, ignore_eos=args.ignore_eos) as target:
            yield target, None
        return
    levels = [c for c in args.max_concurrency if c is not None]
    async with _engine(args, args.max_num_seqs or max([64, *levels])) as engine:
        yield EngineTarget(engine, temperature=args.temperature, ignore_eos=args.ignore_eos), engine


def make_requests(args: argparse.Namespace, engine: Any, num: int, seed: int, max_output: int | None = None):
    """The workload for the flags: token ids in process, text over HTTP."""
    from metrale.bench import workloads

    out_len = min(args.random_output_len, max_output or args.random_output_len)
    if args.dataset == "chat":
        return workloads.chat_requests(num, args.chat_system_len, args.chat_user_len, out_len, seed=seed,
                                       range_ratio=args.random_range_ratio)
    count = (lambda text: len(engine.tokenizer.encode(text))) if engine is not None else workloads.estimate_tokens
    if args.dataset == "sharegpt":
        output_len = args.sharegpt_output_len if max_output is None else max_output
        return workloads.load_sharegpt(args.dataset_path, num, seed=seed, count_tokens=count, output_len=output_len)
    if args.dataset == "custom":
        return workloads.load_custom(args.dataset_path, num, out_len, seed=seed, count_tokens=count)
    if args.dataset == "prefix_repetition":
        return workloads.prefix_repetition_requests(num, args.prefix_repetition_prefix_len,
                                                    args.prefix_repetition_suffix_len,
                                                    args.prefix_repetition_num_prefixes, out_len, seed=seed)
    vocab = engine.vocab_size if engine is not None else None
    return workloads.random_requests(num, args.random_input_len, out_len, seed=seed,
                                     range_ratio=args.random_range_ratio, vocab_size=vocab)


async def _bench(args: argparse.Namespace) -> int:
    from metrale.bench.report import format_comparison, format_sweep

    if args.compare:
        from metrale.bench.targets import OpenAITarget

        url_a, url_b = args.compare
        async with OpenAITarget(url_a, model=args.served_model, api_key=args.api_key, temperature=args.temperature,
                                ignore_eos=args.ignore_eos) as a, \
                OpenAITarget(url_b, model=args.served_model, api_key=args.api_key, temperature=args.temperature,
                             ignore_eos=args.ignore_eos) as b:
            results = await _runs(args, [a, b], None)
        pairs = list(zip(results[::2], results[1::2]))
        print(format_comparison(pairs, (url_a, url_b)))
    else:
        async with open_target(args) as (target, engine):
            results = await _runs(args, [target], engine)
        if len(results) > 1:
            print(format_sweep(results))
    if not args.no_save:
        _save(args, results, "compare" if args.compare else results[0]["backend"])
    return 1 if any(r["failed"] for r in results) else 0


async def _runs(args: argparse.Namespace, targets: list[Any], engine: Any) -> list[dict[str, Any]]:
    """One run per setting (rate x concurrency) on each target in turn, the same prompts for every target."""
    from metrale.bench.arrivals import describe
    from metrale.bench.loadgen import BenchSettings, run_benchmark
    from metrale.bench.report import format_result

    ramp = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps) if args.ramp_up_strategy else None
    levels = [(rate, conc) for conc in args.max_concurrency for rate in args.request_rate]
    results = []
    for i, (rate, conc) in enumerate(levels):
        settings = BenchSettings(request_rate=rate, burstiness=args.burstiness, max_concurrency=conc,
                                 seed=args.seed + i, duration_s=args.duration, ramp_up=ramp)
        requests = make_requests(args, engine, args.num_prompts, args.seed + i)
        for target in targets:
            warm = make_requests(args, engine, args.num_warmups, args.seed + 10_000 + i, max_output=16) \
                if args.num_warmups and i == 0 else []
            arrivals = f"ramp {ramp[0]} {ramp[1]:g}->{ramp[2]:g} req/s" if ramp else describe(rate, args.burstiness, conc)
            label = args.label or f"{target.name} {args.dataset}, {arrivals}"
            result = await run_benchmark(target, requests, settings, warmups=warm, label=label,
                                         percentiles=args.percentiles, show_progress=not args.no_progress,
                                         slos=args.slos, extra={"dataset": args.dataset, "workload_seed": args.seed + i})
            print(format_result(result), flush=True)
            _warn_if_warm(args, result)
            results.append(result)
    return results


def _warn_if_warm(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Random prompts should meet a cold cache; a high hit rate means an earlier run with the same seed warmed it."""
    if args.dataset == "random" and result.get("prefix_cache_hit_rate", 0.0) > 0.1:
        print(f"metrale bench: warning: {result['prefix_cache_hit_rate']:.0%} of the prompt tokens came from the "
              "server's prefix cache (the same --seed ran before?); the TTFT above is a warm-cache figure",
              file=sys.stderr)


def _save(args: argparse.Namespace, results: list[dict[str, Any]], backend: str) -> None:
    from metrale.bench.report import write_json

    stem = args.result_filename.removesuffix(".json") if args.result_filename else \
        f"{'http' if args.base_url else 'metrale'}-{args.dataset}-{datetime.now():%Y%m%d-%H%M%S}"
    path = write_json(Path(args.result_dir) / f"{stem}.json", results, {"command": " ".join(sys.argv)})
    print(f"wrote {path}")
    if args.no_plots:
        return
    from metrale.bench import plots

    x = "max_concurrency" if len(args.max_concurrency) > 1 else "request_rate"
    if len(results) > 1:
        print(f"wrote {plots.plot_throughput({backend: results}, path.with_suffix('.throughput.png'), x=x)}")
    series = {f"{x}={r[x]}" if len(results) > 1 else backend: r for r in results}
    print(f"wrote {plots.plot_latency_cdfs(series, path.with_suffix('.latency.png'))}")


async def _soak(args: argparse.Namespace) -> int:
    from metrale.bench.report import write_json
    from metrale.bench.soak import SoakSettings, format_soak, soak

    rate = args.request_rate[0]
    settings = SoakSettings(duration_s=args.soak_duration, cycle_s=args.soak_cycle,
                            request_rate=1.0 if math.isinf(rate) else rate, cancel_fraction=args.cancel_fraction,
                            input_len=args.random_input_len, output_len=args.random_output_len,
                            range_ratio=args.random_range_ratio or 0.5, seed=args.seed)
    async with _engine(args, args.max_num_seqs or 64) as engine:
        from metrale import SamplingParams

        await engine.complete([200] * 32, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        result = await soak(engine, settings)
    print(format_soak(result))
    if not args.no_save:
        stem = args.result_filename.removesuffix(".json") if args.result_filename else \
            f"soak-{datetime.now():%Y%m%d-%H%M%S}"
        path = write_json(Path(args.result_dir) / f"{stem}.json", [result], {"command": " ".join(sys.argv)})
        print(f"wrote {path}")
        if not args.no_plots:
            from metrale.bench.plots import plot_soak

            print(f"wrote {plot_soak(result, path.with_suffix('.png'))}")
    return 0 if result["verdict"] == "PASS" else 1
