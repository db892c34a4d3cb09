"""metrale and llama.cpp's llama-server over models x prompt lengths x output lengths x streams, on the
same GGUF files, in one run; ONE table of metrale's advantage (output tok/s, TTFT p50, prompt tok/s,
and RSS for the model + a 4k-token context) with issue 23's targets marked met / missed.

    .venv/bin/python benchmarks/peer_matrix.py --estimate-only              # the full matrix's run time
    .venv/bin/python benchmarks/peer_matrix.py --models 135m llama-1b --prompt-lens 128 --streams 1 8 \\
        --output-lens 64 --llama-server PATH

Models: 135m (the default SmolLM2-135M Q4_1 GGUF), llama-1b and llama-3b (Llama-3.2-1B / 3B shapes, random
Q4_0 weights written by gguf_shapes_bench.write_shape into --shapes-dir, reused when there). Per model both
servers start (sized for the largest cell: llama-server -np = the most streams, its context per slot and
metrale's --kv-cache-mib (float16 KV, as llama.cpp's) for the longest prompt + output), every cell runs on
each engine one at a time (compare_peers.measure_one: quiet-machine wait, repeated when disturbed), then
both stop. The RSS part starts each server alone, sized for one --rss-prompt-len + --rss-output-len
context, sends that one request and reads /proc of the server's process tree (benchmarks/peers/rss.py):
idle, peak (sum of VmHWM) and steady (after the request). Over HTTP by default (the 135M targets are
over HTTP); --metrale-in-process runs the cells in this process (the RSS part is always `metrale serve`).
Writes benchmarks/results/<--name>.json and .md; prints an estimate of the run time before starting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import compare_peers
import gguf_shapes_bench as shapes
import psutil
from peers import estimate, matrix_report
from peers.rss import PeakSampler, tree_memory

from metrale.bench.loadgen import run_benchmark
from metrale.bench.workloads import random_requests

MODELS = ("135m", "llama-1b", "llama-3b")
ENGINES = ("metrale", "llama.cpp")
log = compare_peers.log


@dataclass(frozen=True)
class Cell:
    prompt_len: int
    output_len: int
    streams: int


def cells(args: argparse.Namespace) -> list[Cell]:
    return [Cell(p, o, s) for p, o, s in itertools.product(args.prompt_lens, args.output_lens, args.streams)]


def model_path(model: str, args: argparse.Namespace) -> Path:
    """The GGUF of `model`: the default 135M file, or a shape written (once) into --shapes-dir."""
    if model == "135m":
        from metrale.loading.default_model import default_model_path

        return Path(default_model_path())
    folder = Path(args.shapes_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return shapes.write_shape(folder / f"{model}-q4_0.gguf", model)


def planned_shape(model: str, args: argparse.Namespace) -> tuple[dict, int]:
    """(shape, weight bytes) of `model` before its file exists: the metadata a write would give."""
    if model == "135m":
        path = model_path(model, args)
        return shapes.read_shape(path), path.stat().st_size
    shape = shapes.expected_shape(model)
    return shape, estimate.weight_bytes(shape)


def serving(args: argparse.Namespace, streams: int, prompt_len: int, output_len: int,
            **more: Any) -> argparse.Namespace:
    """`args` as compare_peers.open_* read them for servers sized to `streams` of prompt + output."""
    return argparse.Namespace(**{**vars(args), "streams": [streams], "prompt_len": prompt_len,
                                 "output_len": output_len, **more})


def slot_context(prompt_len: int, output_len: int) -> int:
    """Tokens a sequence may hold: llama-server's context per slot, metrale's KV per sequence."""
    return max(512, prompt_len + output_len + 16)


async def open_engine(stack: contextlib.AsyncExitStack, engine: str, sized: argparse.Namespace, path: Path,
                      shape: dict, binary: Path | None) -> compare_peers.Peer:
    """One engine's server for `sized` (streams, prompt_len, output_len), metrale's KV matching llama.cpp's."""
    context = slot_context(sized.prompt_len, sized.output_len)
    if engine == "llama.cpp":
        return await compare_peers.open_llama_cpp(stack, sized, path, binary)
    float16_kv = argparse.Namespace(**{**vars(sized), "metrale_args": f"--kv-cache-dtype float16 {sized.metrale_args}"})
    return await compare_peers.open_metrale(stack, float16_kv, path,
                                            kv_cache_mib=estimate.kv_cache_mib(shape, sized.streams[0], context),
                                            max_model_len=min(context, shape["context_length"]))


async def measure_cells(model: str, path: Path, shape: dict, args: argparse.Namespace, binary: Path | None,
                        record: Callable[[dict], None]) -> dict[str, dict]:
    """Every cell on every engine of `model`, each run given to `record` as it ends; each engine's info."""
    sized = serving(args, max(args.streams), max(args.prompt_lens), max(args.output_lens))
    async with contextlib.AsyncExitStack() as stack:
        peers = [await open_engine(stack, e, sized, path, shape, binary) for e in args.engines]
        watched = {"client": os.getpid(), **{label: pid for p in peers for label, pid in p.processes.items()}}
        for peer in peers:
            log(f"{model} {peer.name}: {peer.info}")
            await run_benchmark(peer.target, random_requests(2, 32, 4, seed=args.seed + 99, vocab_size=shape["vocab"]),
                                show_progress=False)
        for i, cell in enumerate(cells(args)):
            plan = compare_peers.Plan(streams=(cell.streams,), rounds=args.rounds, prompt_len=cell.prompt_len,
                                      output_len=cell.output_len, vocab_size=shape["vocab"],
                                      max_other_busy=args.max_other_busy, max_wait_quiet_s=args.max_wait_quiet,
                                      retries=args.retries, seed=args.seed + 100_000_000 * (i + 1))
            for round_ in range(args.rounds):
                first = (i * args.rounds + round_) % len(peers)
                for peer in [*peers[first:], *peers[:first]]:
                    log(f"{model}: prompt {cell.prompt_len}, output {cell.output_len}, round {round_ + 1}")
                    result = await compare_peers.measure_one(peer, round_, cell.streams, plan, watched)
                    record({"model": model, "prompt_len": cell.prompt_len, "output_len": cell.output_len,
                            "round": round_ + 1, **result})
        return {p.name: p.info for p in peers}


async def measure_rss(engine: str, path: Path, shape: dict, args: argparse.Namespace,
                      binary: Path | None) -> dict[str, Any]:
    """One server alone, sized for one --rss-prompt-len context: its tree's memory idle, during one request
    of that prompt (peak) and after it (steady)."""
    sized = serving(args, 1, args.rss_prompt_len, args.rss_output_len, metrale_in_process=False)
    async with contextlib.AsyncExitStack() as stack:
        peer = await open_engine(stack, engine, sized, path, shape, binary)
        pid = next(iter(peer.processes.values()))  # the server; its children are read through it
        idle = tree_memory(pid)
        request = random_requests(1, args.rss_prompt_len, args.rss_output_len, seed=args.seed + 7,
                                  vocab_size=shape["vocab"])
        with PeakSampler(pid) as sampler:
            result = await run_benchmark(peer.target, request, show_progress=False)
        steady = tree_memory(pid)
    log(f"{engine} RSS: idle {idle['vmrss_bytes'] / 2**30:.2f} GiB, peak {steady['vmhwm_bytes'] / 2**30:.2f} GiB "
        f"(sampled {sampler.peak_rss_bytes / 2**30:.2f}), steady {steady['vmrss_bytes'] / 2**30:.2f} GiB")
    return {"prompt_len": args.rss_prompt_len, "output_len": args.rss_output_len, "ok": result["completed"] == 1,
            "ttft_s": result["median_ttft_ms"] / 1e3, "idle_rss_bytes": idle["vmrss_bytes"],
            "peak_hwm_bytes": steady["vmhwm_bytes"], "peak_sampled_bytes": sampler.peak_rss_bytes,
            "steady_rss_bytes": steady["vmrss_bytes"], "idle": idle, "steady": steady}


def estimate_run(args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per model (file write, server starts, cells, RSS part) and the KV bytes each server holds."""
    per_model, memory = {}, {}
    context = slot_context(max(args.prompt_lens), max(args.output_lens))
    rss_context = slot_context(args.rss_prompt_len, args.rss_output_len)
    for model in args.models:
        shape, size = planned_shape(model, args)
        path = Path(args.shapes_dir) / f"{model}-q4_0.gguf"
        seconds = 0.0 if model == "135m" or path.is_file() else estimate.write_seconds(size)
        seconds += len(args.engines) * estimate.start_seconds(size)
        seconds += len(args.engines) * args.rounds * sum(
            estimate.cell_seconds(shape, size, prompt_len=c.prompt_len, output_len=c.output_len, streams=c.streams)
            for c in cells(args))
        if args.rss_prompt_len:
            seconds += len(args.engines) * (estimate.start_seconds(size) + estimate.prompt_seconds(
                shape, args.rss_prompt_len, args.rss_prompt_len))
        per_model[model] = round(seconds)
        kv = max(args.streams) * context * estimate.kv_bytes_per_token(shape)
        memory[model] = {"weights_gib": round(size / 2**30, 2), "kv_per_server_gib": round(kv / 2**30, 2),
                         "both_servers_gib": round(len(args.engines) * (size + kv) / 2**30, 2),
                         "rss_kv_gib": round(rss_context * estimate.kv_bytes_per_token(shape) / 2**30, 2)}
    return {"total_s": sum(per_model.values()), "per_model_s": per_model, "memory": memory}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--output-lens", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams per cell")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every cell on every engine (medians)")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--rss-prompt-len", type=int, default=4096, help="the RSS request's prompt (0: no RSS part)")
    parser.add_argument("--rss-output-len", type=int, default=16)
    parser.add_argument("--shapes-dir", default="/tmp/metrale-shapes", help="where the shaped GGUFs are (written)")
    parser.add_argument("--estimate-only", action="store_true", help="print the estimate and exit")
    compare_peers.add_engine_arguments(parser)
    parser.add_argument("--name", default="peer_matrix", help="file stem of the JSON and the table")
    args = parser.parse_args(argv)
    lengths = [*args.prompt_lens, *args.output_lens, *args.streams]
    if min(lengths) < 1 or args.rounds < 1 or args.rss_prompt_len < 0 or args.rss_output_len < 1:
        parser.error("prompt / output lengths, streams, rounds and --rss-output-len must be >= 1, "
                     "--rss-prompt-len >= 0")
    return args


class Results:
    """What a matrix run has measured so far, saved (JSON + table) after every cell and RSS record, so that
    a run stopped half way keeps what it measured ("complete": false in its timing)."""

    def __init__(self, args: argparse.Namespace, planned: dict[str, Any]) -> None:
        self.args, self.planned = args, planned
        self.started = time.monotonic()
        self.runs: list[dict] = []
        self.rss: dict[str, dict] = {}
        self.engines: dict[str, dict] = {}
        self.per_model_s: dict[str, float] = {}

    def add_run(self, run: dict[str, Any]) -> None:
        self.runs.append(run)
        self.save(complete=False)

    def add_rss(self, model: str, engine: str, record: dict[str, Any]) -> None:
        self.rss.setdefault(model, {})[engine] = record
        self.save(complete=False)

    def document(self, complete: bool) -> dict[str, Any]:
        timing = {"complete": complete, "total_s": round(time.monotonic() - self.started, 1),
                  "per_model_s": self.per_model_s, "estimate_s": self.planned["total_s"], "estimate": self.planned}
        return matrix_report.result_document(self.runs, self.rss, self.engines, vars(self.args), timing)

    def save(self, complete: bool) -> list[Path]:
        return matrix_report.save(self.document(complete), Path(self.args.out_dir), self.args.name)


async def run(args: argparse.Namespace, results: Results) -> None:
    from peers import servers

    binary = servers.llama_server_binary(args.llama_server) if "llama.cpp" in args.engines else None
    for model in args.models:
        model_started = time.monotonic()
        path = model_path(model, args)
        shape = shapes.read_shape(path)
        log(f"{model}: {path} ({path.stat().st_size / 2**30:.2f} GiB), {shape}")
        results.engines[model] = await measure_cells(model, path, shape, args, binary, results.add_run)
        for engine in args.engines if args.rss_prompt_len else ():
            results.add_rss(model, engine, await measure_rss(engine, path, shape, args, binary))
        results.per_model_s[model] = round(time.monotonic() - model_started, 1)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    planned = estimate_run(args)
    print(f"# estimated run time: {planned['total_s'] / 60:.0f} min ({planned['per_model_s']} s per model; quiet-"
          f"machine waits and repeats not counted); memory: {planned['memory']}", file=sys.stderr, flush=True)
    available = psutil.virtual_memory().available / 2**30
    for model, memory in planned["memory"].items():
        if memory["both_servers_gib"] > 0.8 * available:
            print(f"# WARNING: {model}'s servers want ~{memory['both_servers_gib']:.1f} GiB (weights + KV sized for "
                  f"{max(args.streams)} streams); {available:.1f} GiB is available", file=sys.stderr, flush=True)
    if args.estimate_only:
        return 0
    results = Results(args, planned)
    asyncio.run(run(args, results))
    document = results.document(complete=True)
    print(matrix_report.markdown(document))
    for path in results.save(complete=True):
        print(f"wrote {path}")
    ok = all(r["token_counts_ok"] for r in document["runs"]) and all(
        record["ok"] for by_engine in document["rss"].values() for record in by_engine.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
