"""The comparison's results: medians per engine and level, ratios against the targets, the
markdown table, the plot, and the JSON document.

    document = result_document(runs, engines, vars(args))   # runs: one metrale.bench result per run
    print(markdown(document)); save(document, Path("benchmarks/results"), "compare_peers")
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

# metrale / peer output throughput to reach: llama.cpp's per concurrency, mlx-lm's at every one
LLAMA_CPP_TARGETS = {1: 1.0, 8: 1.3, 32: 1.8}
MLX_LM_TARGET = 2.0
# a machine fact that cannot be read (no /proc, no git, a package missing) is left out
_UNREADABLE = (OSError, StopIteration, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError)


def target_ratio(peer: str, streams: int) -> float | None:
    """The metrale / peer throughput ratio to reach at `streams`, or None when there is none."""
    if peer == "llama.cpp":
        return LLAMA_CPP_TARGETS.get(streams)
    return MLX_LM_TARGET if peer == "mlx-lm" else None


def level_summary(runs: Sequence[Mapping[str, Any]], streams: int, engines: Sequence[str]) -> dict[str, Any]:
    """Medians over the rounds of one level, and metrale's ratio to each peer."""
    by_engine = {e: [r for r in runs if r["engine"] == e and r["streams"] == streams] for e in engines}
    tput = {e: [r["output_throughput"] for r in rs] for e, rs in by_engine.items() if rs}
    ttft = {e: [r["mean_ttft_ms"] for r in rs] for e, rs in by_engine.items() if rs}
    level: dict[str, Any] = {
        "streams": streams,
        "output_throughput": {e: statistics.median(v) for e, v in tput.items()},
        "output_throughput_per_round": tput,
        "mean_ttft_ms": {e: statistics.median(v) for e, v in ttft.items()},
        "ratios": {},
    }
    ours = level["output_throughput"].get("metrale")
    for peer, theirs in level["output_throughput"].items():
        if peer == "metrale" or ours is None:
            continue
        ratio = ours / theirs if theirs else float("inf")
        goal = target_ratio(peer, streams)
        level["ratios"][peer] = {"ratio": ratio, "target": goal, "met": None if goal is None else ratio >= goal}
    return level


def summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every level's medians and ratios, and how quiet the machine was."""
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    levels = sorted({r["streams"] for r in runs})
    loads = [v for r in runs for v in (r["quiet"]["load_average_before"][0], r["load_average_after"][0])]
    return {
        "engines": engines,
        "levels": [level_summary(runs, s, engines) for s in levels],
        "load_average_1m": [min(loads), max(loads)],
        "max_other_cpu_during_run": max(r["cpu"]["other"] for r in runs),
        "max_steal_during_run": max(r["cpu"]["steal"] for r in runs),
        "all_runs_started_quiet": all(r["quiet"]["quiet"] for r in runs),
        "disturbed_runs_repeated": sum(len(r.get("disturbed_attempts", ())) for r in runs),
        "token_counts_ok": all(r["token_counts_ok"] for r in runs),
    }


def machine() -> dict[str, Any]:
    """Where it ran: CPU, cores, versions, the metrale commit."""
    cpu = platform.processor()
    with contextlib.suppress(*_UNREADABLE):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    versions = {}
    for package in ("mlx", "mlx-lm"):
        with contextlib.suppress(*_UNREADABLE):
            versions[package] = importlib.metadata.version(package)
    commit = None
    with contextlib.suppress(*_UNREADABLE):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=Path(__file__).parent).stdout.strip()
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "versions": versions,
            "metrale_commit": commit}


def result_document(runs: list[dict[str, Any]], engines: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: date, machine, arguments, engines, summary and every run."""
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "args": dict(args), "engines": dict(engines), "summary": summary(runs), "runs": runs}


def _x(value: float) -> str:
    return f"{value:.2f}x"


def markdown(document: Mapping[str, Any]) -> str:
    """The table: throughput per engine, ratios with their targets, mean TTFT; then the conditions."""
    s = document["summary"]
    engines, peers = s["engines"], [e for e in s["engines"] if e != "metrale"]
    ratio_peers = peers if "metrale" in engines else []
    header = (["streams"] + [f"{e} tok/s" for e in engines] + [f"metrale / {p}" for p in ratio_peers]
              + ["mean TTFT (s): " + " / ".join(engines)])
    rows = ["| " + " | ".join(header) + " |", "|" + "---:|" * (1 + len(engines)) + "---|" * (len(ratio_peers) + 1)]
    for level in s["levels"]:
        cells = [str(level["streams"])] + [f"{level['output_throughput'].get(e, float('nan')):.1f}" for e in engines]
        for peer in ratio_peers:
            r = level["ratios"].get(peer)
            if r is None:
                cells.append("-")
            elif r["target"] is None:
                cells.append(_x(r["ratio"]))
            else:
                cells.append(f"{_x(r['ratio'])} (>= {r['target']:.1f}x: {'met' if r['met'] else 'missed'})")
        cells.append(" / ".join(f"{level['mean_ttft_ms'].get(e, float('nan')) / 1e3:.2f}" for e in engines))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + conditions(document) + "\n"


def conditions(document: Mapping[str, Any]) -> str:
    """How it was measured, in a paragraph under the table."""
    s, args, m = document["summary"], document["args"], document["machine"]
    how = "; ".join(f"{name}: " + ", ".join(str(info[k]) for k in ("transport", "version", "cpu_backend", "weights")
                                             if info.get(k))
                    for name, info in document["engines"].items())
    lines = [
        f"{args['prompt_len']} random prompt tokens, {args['output_len']} output tokens, greedy, ignore_eos, "
        f"all requests at t=0; median of {args['rounds']} round(s), engines alternating (one at a time). {how}.",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs; 1-min load average {s['load_average_1m'][0]:.2f}-"
        f"{s['load_average_1m'][1]:.2f} before/after the runs (the engine under test counts in it); other processes used at most "
        f"{s['max_other_cpu_during_run']:.0%} of the machine during a run (steal at most "
        f"{s['max_steal_during_run']:.0%}; {s['disturbed_runs_repeated']} disturbed runs were repeated); "
        f"every run started quiet: {s['all_runs_started_quiet']}; "
        f"token counts as asked in every run: {s['token_counts_ok']}.",
    ]
    return "\n".join(lines)


def plot(document: Mapping[str, Any], path: Path) -> Path:
    """Grouped bars per level: output tok/s (whiskers: min-max over rounds) and mean TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    s = document["summary"]
    engines, levels = s["engines"], s["levels"]
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        xs = [k + (i - (len(engines) - 1) / 2) * width for k in range(len(levels))]
        tput = [lv["output_throughput"].get(engine, 0.0) for lv in levels]
        rounds = [lv["output_throughput_per_round"].get(engine, [0.0]) for lv in levels]
        errors = [[t - min(r) for t, r in zip(tput, rounds)], [max(r) - t for t, r in zip(tput, rounds)]]
        bars = ax_tput.bar(xs, tput, width, yerr=errors, capsize=3, label=engine)
        ax_tput.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        ax_ttft.bar(xs, [lv["mean_ttft_ms"].get(engine, 0.0) / 1e3 for lv in levels], width, label=engine)
    for ax, ylabel in ((ax_tput, "output tokens / s (median)"), (ax_ttft, "mean TTFT (s, median)")):
        ax.set_xticks(range(len(levels)), [f"{lv['streams']} streams" for lv in levels])
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    ax_ttft.set_yscale("log")
    ax_ttft.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_ttft.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    args = document["args"]
    fig.suptitle(f"{args['prompt_len']} prompt + {args['output_len']} output tokens, all at t=0; "
                 f"{document['machine']['cpu_count']} CPUs, load {s['load_average_1m'][0]:.1f}-"
                 f"{s['load_average_1m'][1]:.1f}; median of {args['rounds']} round(s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(document: Mapping[str, Any], out_dir: Path, name: str) -> list[Path]:
    """<name>.json (per-request inter-token gaps left out: small files), .md and .png."""
    from metrale.bench.report import write_json

    runs = [{**r, "details": {k: v for k, v in r["details"].items() if k != "itls"}} for r in document["runs"]]
    paths = [write_json(out_dir / f"{name}.json", [{**document, "runs": runs}])]
    paths.append(out_dir / f"{name}.md")
    paths[-1].write_text(markdown(document))
    paths.append(plot(document, out_dir / f"{name}.png"))
    return paths
