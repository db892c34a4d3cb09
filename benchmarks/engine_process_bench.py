"""The engine process against the in-process engine, over HTTP, in one run: `metrale serve` with
--no-engine-process, then with its engine process (the default); for each, `metrale bench` at 1 and 32
concurrent streams (random prompts, ignore_eos), then, for the engine process, the restart time after
kill -SEGV of the child (kill -> /health 200, and kill -> the first completion that succeeds).

    .venv/bin/python benchmarks/engine_process_bench.py                      # default model
    .venv/bin/python benchmarks/engine_process_bench.py --output-len 64 --prompts-32 64 --kills 3
    .venv/bin/python benchmarks/engine_process_bench.py --engine-process-first --kills 0   # the other order

Prints one line per measurement and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.serve import ServerProcess  # noqa: E402


def engine_pid(server: ServerProcess) -> int:
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"metrale.engine.engine_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise RuntimeError("no engine process")


def bench(server: ServerProcess, concurrency: int, prompts: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as results:
        subprocess.run([sys.executable, "-m", "metrale.cli", "bench", "--base-url", server.url(), "--no-plots",
                        "--no-progress", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
                        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                        "--num-warmups", "1", "--result-dir", results, "--seed", "0"],
                       cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        (path,) = Path(results).glob("*.json")
        data = json.loads(path.read_text())
    return {"concurrency": concurrency, "prompts": prompts, "output_throughput": data["output_throughput"],
            "median_ttft_ms": data["median_ttft_ms"], "median_tpot_ms": data.get("median_tpot_ms")}


def restart_times(server: ServerProcess) -> dict:
    pid = engine_pid(server)
    killed = time.monotonic()
    os.kill(pid, signal.SIGSEGV)
    while server.get("/health")[0] != 503:  # the server noticed
        time.sleep(0.01)
    while server.get("/health")[0] != 200:
        time.sleep(0.02)
    healthy = time.monotonic() - killed
    status, _ = server.post("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    assert status == 200, status
    return {"health_ok_s": round(healthy, 3), "first_completion_s": round(time.monotonic() - killed, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompts-1", type=int, default=4)
    parser.add_argument("--prompts-32", type=int, default=64)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--engine-process-first", action="store_true", help="run the engine process first (order drift)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_process.json"))
    args = parser.parse_args()
    model = ("--model", args.model) if args.model else ()
    result = {"machine": platform.platform(), "cpus": os.cpu_count(), "args": vars(args), "runs": []}
    modes = ["--no-engine-process", "--engine-process"]
    for mode in reversed(modes) if args.engine_process_first else modes:
        with ServerProcess(*model, mode, "--max-num-seqs", "32", startup_timeout_s=600) as server:
            run = {"mode": mode.removeprefix("--"), "startup_s": round(server.startup_s, 2), "bench": []}
            for concurrency, prompts in ((1, args.prompts_1), (32, args.prompts_32)):
                run["bench"].append(bench(server, concurrency, prompts, args))
                print(mode, run["bench"][-1], flush=True)
            if mode == "--engine-process":
                kills = [restart_times(server) for _ in range(args.kills)]
                run["restarts"] = kills
                run["restart_median_s"] = statistics.median(k["health_ok_s"] for k in kills) if kills else None
                print(mode, "restarts", kills, flush=True)
            result["runs"].append(run)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
