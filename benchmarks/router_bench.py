"""Replicas behind sglang-router: the latency routing adds, and prefix-cache hits by routing policy.

    .venv/bin/python benchmarks/router_bench.py                  # the README's table
    .venv/bin/python benchmarks/router_bench.py --num-prompts 16 --setups direct router-1   # quicker

Setups, each started fresh (empty prefix caches), on the default model unless --model:
    direct          one `metrale serve`; the load goes to it
    router-1        `metrale fleet --replicas 1` (cache_aware); the load goes to the router
    cache_aware-2   `metrale fleet --replicas 2 --policy cache_aware`
    round_robin-2   `metrale fleet --replicas 2 --policy round_robin`
For each: one warm-up request to every replica, a probe of the added latency (--probe sequential
1-token completions, median and p90), then `metrale bench --base-url <target> --dataset chat` (every
request shares one system prompt), with each replica's counters read from its /metrics before and
after the bench: prefix hit rate = prefix_cache_hits / prefix_cache_queries (prompt tokens), prompt
tokens computed, requests served. Prints a markdown table; writes benchmarks/results/router_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
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
SETUPS = {"direct": (1, None), "router-1": (1, "cache_aware"), "cache_aware-2": (2, "cache_aware"),
          "round_robin-2": (2, "round_robin")}
COUNTERS = ("metrale_prefix_cache_hits_total", "metrale_prefix_cache_queries_total", "metrale_prompt_tokens_total",
            "metrale_request_success_total")


@dataclass
class Running:
    """A started setup: the URL to load, the replicas' URLs, and the process to stop."""

    target: str
    replicas: list[str]
    proc: subprocess.Popen

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(setup: str, serve_args: list[str]) -> Running:
    replicas, policy = SETUPS[setup]
    port = free_port()
    metrale = [sys.executable, "-m", "metrale.cli"]
    if policy is None:
        proc = subprocess.Popen([*metrale, "serve", "--port", str(port), *serve_args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: _status(url + "/health") == 200, proc, "metrale serve")
        return Running(url, [url], proc)
    proc = subprocess.Popen([*metrale, "fleet", "--replicas", str(replicas), "--policy", policy, "--port", str(port),
                             *serve_args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    urls: list[str] = []
    while len(urls) < replicas:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"metrale fleet exited with {proc.returncode}")
        match = re.match(r"metrale fleet: replica-\d+ (http://\S+)", line)
        if match:
            urls.append(match.group(1))
    return Running(f"http://127.0.0.1:{port}", urls, proc)


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _wait(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.2)


def counters(replica: str) -> dict[str, float]:
    text = httpx.get(replica + "/metrics", timeout=10).text
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def probe(target: str, model: str, count: int) -> dict[str, float]:
    """Sequential 1-token completions on one keep-alive connection: latency in ms."""
    latencies = []
    with httpx.Client(base_url=target, timeout=60) as client:
        for i in range(count):
            t0 = time.perf_counter()
            response = client.post("/v1/completions", json={"model": model, "prompt": f"Hi {i}", "max_tokens": 1})
            latencies.append((time.perf_counter() - t0) * 1e3)
            response.raise_for_status()
    latencies.sort()
    return {"probe_median_ms": statistics.median(latencies), "probe_p90_ms": latencies[int(0.9 * (count - 1))]}


def bench(target: str, args: argparse.Namespace, out_dir: Path, name: str) -> dict:
    command = [sys.executable, "-m", "metrale.cli", "bench", "--base-url", target, "--dataset", "chat",
               "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
               "--random-output-len", str(args.output_len), "--chat-system-len", str(args.system_len),
               "--num-warmups", "0", "--seed", str(args.seed), "--no-plots", "--no-progress",
               "--result-dir", str(out_dir), "--result-filename", name]
    print("   ", " ".join(["metrale", *command[3:]]), flush=True)
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / f"{name}.json").read_text())


def run_setup(setup: str, args: argparse.Namespace, out_dir: Path) -> dict:
    running = start(setup, args.serve_args)
    try:
        model = httpx.get(running.target + "/v1/models", timeout=10).json()["data"][0]["id"]
        for replica in running.replicas:  # first forward passes are slower; not part of any figure
            httpx.post(replica + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=120)
        result = {"setup": setup, "replicas": len(running.replicas), "policy": SETUPS[setup][1],
                  **probe(running.target, model, args.probe)}
        before = [counters(r) for r in running.replicas]
        run = bench(running.target, args, out_dir, setup)
        after = [counters(r) for r in running.replicas]
    finally:
        status = running.stop()
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    hits = sum(d["metrale_prefix_cache_hits_total"] for d in delta)
    queries = sum(d["metrale_prefix_cache_queries_total"] for d in delta)
    keys = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
            "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms")
    result.update({k: run[k] for k in keys})
    result.update({"prefix_hit_rate": hits / queries if queries else 0.0,
                   "prompt_tokens_computed": int(sum(d["metrale_prompt_tokens_total"] for d in delta)),
                   "requests_per_replica": [int(d["metrale_request_success_total"]) for d in delta],
                   "exit_status": status})
    return result


def table(results: list[dict]) -> str:
    lines = ["| setup | req/s | output tok/s | TTFT mean / p99 (ms) | ITL mean (ms) | E2E mean (ms) | "
             "1-token probe median / p90 (ms) | prefix hit rate | prompt tokens computed | requests per replica |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['setup']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     f"{r['mean_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['mean_itl_ms']:.0f} | "
                     f"{r['mean_e2el_ms']:.0f} | {r['probe_median_ms']:.1f} / {r['probe_p90_ms']:.1f} | "
                     f"{r['prefix_hit_rate']:.1%} | {r['prompt_tokens_computed']} | "
                     f"{' / '.join(map(str, r['requests_per_replica']))} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", choices=tuple(SETUPS), default=list(SETUPS))
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=256, help="words in the shared system prompt")
    parser.add_argument("--probe", type=int, default=40, help="sequential 1-token requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-args", default="--kv-cache-mib 256", help="extra `metrale serve` flags, one string")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/router_bench.json"))
    args = parser.parse_args()
    args.serve_args = args.serve_args.split()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for setup in args.setups:
            print(f"{setup}: load average {os.getloadavg()[0]:.2f}", flush=True)
            results.append({**run_setup(setup, args, Path(tmp)), "load_average_1m": os.getloadavg()[0]})
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "settings": {
        k: v for k, v in vars(args).items() if k != "out"}, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(r["failed"] == 0 and r["exit_status"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
