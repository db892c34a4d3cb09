"""Replicas behind sglang-router: the latency routing adds, and prefix-cache hits by routing policy.

    .venv/bin/python benchmarks/router_bench.py          # the README's tables (~15 min on 2 busy cores)

The machine is shared and its load drifts, so every comparison is interleaved, never run one setup
after the other:

1. Routing overhead. `metrale fleet --replicas 1` (cache_aware). A probe alternates --probe pairs of
   1-token completions sent to the replica directly and through the router (median, p90, and the
   median of the per-pair difference). Then `metrale bench --dataset chat` four times, ABBA: direct
   (seed s), router (s+1), router (s+2), direct (s+3); each seed has its own shared system prompt.
2. Policies. Two fleets at once, `--replicas 2 --policy cache_aware` and `--policy round_robin`, fresh
   (empty prefix caches); `metrale bench` ABBA against the routers: cache_aware (seed s), round_robin
   (s), round_robin (s+1), cache_aware (s+1). Each replica's counters are read from its /metrics
   before and after every run: prefix hit rate = prefix_cache_hits / prefix_cache_queries (prompt
   tokens), prompt tokens computed, requests served per replica.

Every bench run: --num-prompts requests, --max-concurrency in flight, one shared system prompt of
--system-len words, --output-len tokens, no warm-up (each replica gets one request first, not
counted). Prints markdown tables; writes benchmarks/results/router_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = ("metrale_prefix_cache_hits_total", "metrale_prefix_cache_queries_total", "metrale_prompt_tokens_total",
            "metrale_prompt_tokens_cached_total", "metrale_request_success_total")
BENCH_KEYS = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
              "mean_itl_ms", "mean_e2el_ms")


@dataclass
class Fleet:
    """A running `metrale fleet`: its router's URL and its replicas' URLs."""

    router: str
    replicas: list[str]
    proc: subprocess.Popen

    @classmethod
    def start(cls, replicas: int, policy: str, serve_args: list[str]) -> "Fleet":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "metrale.cli", "fleet", "--replicas", str(replicas),
                                 "--policy", policy, "--port", str(port), *serve_args], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        urls: list[str] = []
        while len(urls) < replicas:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"metrale fleet exited with {proc.returncode}")
            match = re.match(r"metrale fleet: replica-\d+ (http://\S+)", line)
            if match:
                urls.append(match.group(1))
        fleet = cls(f"http://127.0.0.1:{port}", urls, proc)
        for url in urls:  # first forward passes are slower; not part of any figure
            httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=300)
        return fleet

    def counters(self) -> list[dict[str, float]]:
        return [_counters(url) for url in self.replicas]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(120)
        self.proc.stdout.close()
        return status


def _counters(replica: str) -> dict[str, float]:
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(replica + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def probe(direct: str, routed: str, pairs: int) -> dict[str, float]:
    """Alternating 1-token completions, each target on its own keep-alive connection (ms)."""
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(base_url=direct, timeout=60) as to_replica, httpx.Client(base_url=routed, timeout=60) as to_router:
        model = to_router.get("/v1/models").json()["data"][0]["id"]
        for i in range(pairs):
            for name, client in (("direct", to_replica), ("router", to_router))[:: 1 if i % 2 else -1]:
                t0 = time.perf_counter()
                client.post("/v1/completions", json={"model": model, "prompt": f"Hi {i}", "max_tokens": 1}
                            ).raise_for_status()
                times[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, values in times.items():
        ordered = sorted(values)
        out[f"{name}_median_ms"] = statistics.median(ordered)
        out[f"{name}_p90_ms"] = ordered[int(0.9 * (len(ordered) - 1))]
    out["median_added_ms"] = statistics.median(r - d for d, r in zip(times["direct"], times["router"]))
    return out


def bench(target: str, seed: int, args: argparse.Namespace, out_dir: Path, name: str) -> dict:
    command = [sys.executable, "-m", "metrale.cli", "bench", "--base-url", target, "--dataset", "chat",
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
               "--random-output-len", str(args.output_len), "--chat-system-len", str(args.system_len),
               "--num-warmups", "0", "--seed", str(seed), "--no-plots", "--no-progress",
               "--result-dir", str(out_dir), "--result-filename", name]
    print(f"  [{os.getloadavg()[0]:.1f}]", " ".join(["metrale", *command[3:-4]]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    run = json.loads((out_dir / f"{name}.json").read_text())
    return {"seed": seed, "load_average_1m": os.getloadavg()[0], **{k: run[k] for k in BENCH_KEYS}}


def routing_overhead(args: argparse.Namespace, out_dir: Path) -> dict:
    fleet = Fleet.start(1, "cache_aware", args.serve_args)
    try:
        result = {"probe": probe(fleet.replicas[0], fleet.router, args.probe), "runs": []}
        for i, target in enumerate(("direct", "router", "router", "direct")):
            url = fleet.replicas[0] if target == "direct" else fleet.router
            result["runs"].append({"target": target, **bench(url, args.seed + i, args, out_dir, f"overhead-{i}")})
    finally:
        result["exit_status"] = fleet.stop()
    return result


def policies(args: argparse.Namespace, out_dir: Path) -> dict:
    fleets = {policy: Fleet.start(2, policy, args.serve_args) for policy in ("cache_aware", "round_robin")}
    runs = []
    try:
        for i, policy in enumerate(("cache_aware", "round_robin", "round_robin", "cache_aware")):
            fleet = fleets[policy]
            before = fleet.counters()
            run = bench(fleet.router, args.seed + i // 2, args, out_dir, f"policy-{i}")
            delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(fleet.counters(), before)]
            hits, queries = (sum(d[f"metrale_prefix_cache_{k}_total"] for d in delta) for k in ("hits", "queries"))
            runs.append({"policy": policy, **run, "prefix_hit_rate": hits / queries if queries else 0.0,
                         "prompt_tokens_computed": int(sum(d["metrale_prompt_tokens_total"]  # whole prompts, less the
                                                              - d["metrale_prompt_tokens_cached_total"]  # cache hits
                                                              for d in delta)),
                         "requests_per_replica": [int(d["metrale_request_success_total"]) for d in delta]})
    finally:
        statuses = {policy: fleet.stop() for policy, fleet in fleets.items()}
    return {"runs": runs, "exit_status": statuses}


def tables(overhead: dict, by_policy: dict) -> str:
    p = overhead["probe"]
    lines = [f"1-token completions in alternating pairs: direct median {p['direct_median_ms']:.1f} ms "
             f"(p90 {p['direct_p90_ms']:.1f}), through the router {p['router_median_ms']:.1f} ms "
             f"(p90 {p['router_p90_ms']:.1f}); median added per pair {p['median_added_ms']:.1f} ms", "",
             "| target (1 replica) | seed | load | req/s | output tok/s | TTFT mean / p99 (ms) | ITL mean (ms) | "
             "E2E mean (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in overhead["runs"]:
        lines.append(f"| {r['target']} | {r['seed']} | {r['load_average_1m']:.1f} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['mean_itl_ms']:.0f} | {r['mean_e2el_ms']:.0f} |")
    lines += ["", "| policy (2 replicas) | seed | load | req/s | output tok/s | TTFT mean / p99 (ms) | E2E mean (ms) | "
              "prefix hit rate | prompt tokens computed | requests per replica |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in by_policy["runs"]:
        lines.append(f"| {r['policy']} | {r['seed']} | {r['load_average_1m']:.1f} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['mean_e2el_ms']:.0f} | {r['prefix_hit_rate']:.1%} | {r['prompt_tokens_computed']} | "
                     f"{' / '.join(map(str, r['requests_per_replica']))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--system-len", type=int, default=256, help="words in the shared system prompt")
    parser.add_argument("--probe", type=int, default=40, help="pairs of 1-token requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="--kv-cache-mib 256", help="extra `metrale serve` flags, one string")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/router_bench.json"))
    args = parser.parse_args()
    args.serve_args = args.serve_args.split()
    with tempfile.TemporaryDirectory() as tmp:
        print("routing overhead (1 replica)", flush=True)
        overhead = routing_overhead(args, Path(tmp))
        print("policies (2 replicas each)", flush=True)
        by_policy = policies(args, Path(tmp))
    print(tables(overhead, by_policy))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "settings": settings,
                                          "routing_overhead": overhead, "policies": by_policy}, indent=1) + "\n")
    print(f"wrote {args.out}")
    runs = overhead["runs"] + by_policy["runs"]
    statuses = [overhead["exit_status"], *by_policy["exit_status"].values()]
    return 0 if all(r["failed"] == 0 for r in runs) and not any(statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
