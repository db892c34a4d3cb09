"""Many models in one `metrale serve`: time to first token of a cold model (its load included) against a resident
one, and the RSS of the server and its engine processes over a scripted day of requests across 3 models under a
memory budget that holds 2.

    .venv/bin/python benchmarks/model_swap_bench.py                    # default model + 2 random ~100 MB GGUFs
    .venv/bin/python benchmarks/model_swap_bench.py --idle-unload-after 4 --out /tmp/swap.json

Models: the default model (SmolLM2-135M Q4_1) as "smol", and two random-weight llama GGUFs ("rand-a", "rand-b",
hidden 512, 8 layers, float32: ~100 MB each) written into a temporary --models folder. The budget
(--max-resident-bytes) is the two largest models' counted bytes (file + KV pool) plus half the smallest's: any two
fit, three do not. Each phase of the day sends `--requests` streamed completions to one model, one after another,
and records the first one's TTFT (cold when the model was not resident) and the median of the others (resident);
then the models resident (/api/ps) and the RSS of the server process plus its engine processes. An "idle" phase
waits past --idle-unload-after; the last phase asks with Ollama's keep_alive 0. Prints the timeline; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # `peers`, as peer_matrix.py imports it

import psutil  # noqa: E402

from metrale.loading.default_model import default_model_path  # noqa: E402
from peers.rss import tree_memory  # noqa: E402
from tests.metrale.model_helpers import write_tiny_model  # noqa: E402
from tests.server.serve import ServerProcess  # noqa: E402

RANDOM_MODEL = {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536, "num_attention_heads": 8,
                "num_key_value_heads": 4, "max_position_embeddings": 512}
# (clock label, model or "idle", how the requests go): a day that makes the budget evict, twice
DAY = [("08:00", "smol", "openai"), ("09:00", "rand-a", "openai"), ("10:00", "smol", "openai"),
       ("11:00", "rand-b", "openai"), ("12:00", "rand-a", "openai"), ("13:00", "idle", ""),
       ("14:00", "smol", "openai"), ("15:00", "rand-b", "keep_alive 0")]


def ttft(server: ServerProcess, model: str, ollama_keep_alive: float | None = None) -> float:
    """Seconds from sending a streamed request to its first token (a load included when the model is cold)."""
    conn = server.connection(timeout_s=600)
    if ollama_keep_alive is None:
        path, body = "/v1/completions", {"model": model, "prompt": "Once upon a time", "max_tokens": 8,
                                         "stream": True, "temperature": 0}
    else:
        path, body = "/api/generate", {"model": model, "prompt": "Once upon a time", "keep_alive": ollama_keep_alive,
                                       "options": {"num_predict": 8, "temperature": 0}}
    start = time.perf_counter()
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{model}: HTTP {response.status}: {response.read()[:300]!r}")
        first = None
        for line in response:
            if first is None and line.strip() and line.strip() != b"data: [DONE]":
                first = time.perf_counter() - start
        return first
    finally:
        conn.close()


def tree_rss_bytes(pid: int) -> tuple[int, int]:
    """(RSS of `pid` and all its descendants, how many of them are engine processes)."""
    memory = tree_memory(pid)
    engines = 0
    for child in memory["processes"]:
        try:
            engines += "metrale.engine.engine_process" in psutil.Process(int(child)).cmdline()
        except psutil.NoSuchProcess:
            continue  # exited meanwhile
    return memory["vmrss_bytes"], engines


def resident(server: ServerProcess) -> list[str]:
    status, body = server.get("/api/ps")
    return sorted(m["name"] for m in json.loads(body)["models"])


def run_day(server: ServerProcess, requests: int, idle_s: float) -> list[dict]:
    timeline = []
    for clock, model, how in DAY:
        before = resident(server)
        row: dict = {"clock": clock, "model": model, "resident_before": before}
        if model == "idle":
            time.sleep(idle_s)
        elif how == "keep_alive 0":
            row["cold_ttft_s"] = ttft(server, model, ollama_keep_alive=0) if model not in before else None
            time.sleep(1.0)  # the unload runs once the response has ended
        else:
            first = ttft(server, model)
            rest = [ttft(server, model) for _ in range(requests - 1)]
            row["cold" if model not in before else "warm"] = True
            row["first_ttft_s"], row["resident_ttft_s"] = first, statistics.median(rest) if rest else None
        rss, engines = tree_rss_bytes(server.proc.pid)
        row.update(resident_after=resident(server), rss_bytes=rss, engine_processes=engines)
        timeline.append(row)
        print(f"{clock} {model:7s} first {_s(row.get('first_ttft_s', row.get('cold_ttft_s'))):>8s} "
              f"resident {_s(row.get('resident_ttft_s')):>8s}  RSS {rss / 2**20:7.0f} MiB  "
              f"engines {engines}  resident {','.join(row['resident_after']) or '-'}", flush=True)
    return timeline


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4, help="requests per phase (the first may be cold)")
    parser.add_argument("--kv-cache-mib", type=int, default=32)
    parser.add_argument("--idle-unload-after", type=float, default=5.0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/model_swap_bench.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="metrale-models-") as folder:
        models = Path(folder)
        (models / "smol.gguf").symlink_to(default_model_path())
        for seed, name in enumerate(("rand-a", "rand-b")):
            write_tiny_model(str(models / f"{name}.gguf"), seed=seed, **RANDOM_MODEL)
        counted = sorted(p.stat().st_size + (args.kv_cache_mib << 20) for p in models.iterdir())
        budget = counted[-1] + counted[-2] + counted[0] // 2
        print(f"models counted at {[round(c / 2**20) for c in counted]} MiB; budget {budget / 2**20:.0f} MiB",
              flush=True)
        with ServerProcess("--models", folder, "--max-resident-bytes", str(budget), "--kv-cache-mib",
                           str(args.kv_cache_mib), "--max-model-len", "512",
                           "--idle-unload-after", str(args.idle_unload_after)) as server:
            idle_rss, _ = tree_rss_bytes(server.proc.pid)
            print(f"server up, no model loaded: RSS {idle_rss / 2**20:.0f} MiB", flush=True)
            timeline = run_day(server, args.requests, args.idle_unload_after + 3.0)
    Path(args.out).write_text(json.dumps({"budget_bytes": budget, "counted_bytes": counted,
                                          "server_only_rss_bytes": idle_rss, "kv_cache_mib": args.kv_cache_mib,
                                          "idle_unload_after_s": args.idle_unload_after, "timeline": timeline},
                                         indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
