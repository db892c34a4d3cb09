"""benchmarks/peer_matrix.py's results: per cell (model x prompt x output x streams) the medians of each
engine, metrale's advantage over llama.cpp per measure, issue 23's targets marked met / missed, one
markdown table, and the JSON document.

The advantage is always "> 1: metrale better": output and prompt tok/s are metrale / llama.cpp, TTFT
and RSS are llama.cpp / metrale. A cell's prompt tok/s is its prompt tokens / the last first token's
time (all requests start at t=0), so at one stream it is prompt_len / TTFT.

    document = result_document(runs, rss, engines, args, timing)
    print(markdown(document)); save(document, Path("benchmarks/results"), "peer_matrix")
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from peers.report import machine

GiB = 2**30
CELL_MEASURES = ("output_tok_s", "ttft_p50_s", "prompt_tok_s")
RSS_MEASURES = ("peak_rss_gib", "steady_rss_gib")
LOWER_IS_BETTER = {"ttft_p50_s", "peak_rss_gib", "steady_rss_gib"}
MEASURE_NAMES = {"output_tok_s": "output tok/s", "ttft_p50_s": "TTFT p50 (s)", "prompt_tok_s": "prompt tok/s",
                 "peak_rss_gib": "peak RSS (GiB, sum of VmHWM)", "steady_rss_gib": "steady RSS (GiB, after it)"}


@dataclass(frozen=True)
class Target:
    """Issue 23: metrale's advantage on `measure` >= `at_least` (> when `strict`) in every cell of
    `model` with these streams / prompt length (None: any)."""

    label: str
    model: str
    measure: str
    at_least: float
    streams: int | None = None
    prompt_len: int | None = None
    strict: bool = False

    def applies(self, row: Mapping[str, Any]) -> bool:
        return (row["model"] == self.model and row["measure"] == self.measure
                and self.streams in (None, row.get("streams")) and self.prompt_len in (None, row.get("prompt_len")))

    def met_by(self, advantage: float) -> bool:
        return advantage > self.at_least if self.strict else advantage >= self.at_least


def _shape_targets(model: str, name: str) -> list[Target]:
    return [Target(f"{name}: prompt processing (TTFT p50 at a 512-token prompt, 1 stream) >= 1.2x", model,
                   "ttft_p50_s", 1.2, streams=1, prompt_len=512),
            *(Target(f"{name}: output tok/s >= {goal}x at {s} stream{'s' * (s > 1)}", model, "output_tok_s", goal,
                     streams=s) for s, goal in ((1, 1.0), (8, 1.5), (32, 2.0)))]


TARGETS = (
    *_shape_targets("llama-1b", "1B"),
    *_shape_targets("llama-3b", "3B"),
    Target("3B: peak RSS, model + a 4k-token context, below llama.cpp's", "llama-3b", "peak_rss_gib", 1.0,
           strict=True),
    Target("135M: output tok/s >= 1.3x at 8 streams", "135m", "output_tok_s", 1.3, streams=8),
    Target("135M: output tok/s >= 1.8x at 32 streams", "135m", "output_tok_s", 1.8, streams=32),
    Target("135M: TTFT p50 at a 2048-token prompt (1 stream) <= llama.cpp's", "135m", "ttft_p50_s", 1.0, streams=1,
           prompt_len=2048),
)


def prompt_tok_s(run: Mapping[str, Any]) -> float:
    """The run's prompt tokens / its last first token's time (s); 0 without one."""
    last = max(run["details"]["ttfts"], default=0.0)
    return run["total_input_tokens"] / last if last > 0 else 0.0


def _advantage(measure: str, ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or min(ours, theirs) <= 0:
        return None
    return theirs / ours if measure in LOWER_IS_BETTER else ours / theirs


def cell_rows(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (cell, measure), cells in run order: each engine's median over rounds and the advantage."""
    cells: dict[tuple, list[Mapping[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["model"], run["prompt_len"], run["output_len"], run["streams"]), []).append(run)
    rows = []
    for (model, prompt_len, output_len, streams), cell_runs in cells.items():
        values: dict[str, dict[str, float]] = {m: {} for m in CELL_MEASURES}
        for engine in dict.fromkeys(r["engine"] for r in cell_runs):
            mine = [r for r in cell_runs if r["engine"] == engine]
            values["output_tok_s"][engine] = statistics.median(r["output_throughput"] for r in mine)
            values["ttft_p50_s"][engine] = statistics.median(r["median_ttft_ms"] for r in mine) / 1e3
            values["prompt_tok_s"][engine] = statistics.median(prompt_tok_s(r) for r in mine)
        for measure in CELL_MEASURES:
            rows.append({"model": model, "prompt_len": prompt_len, "output_len": output_len, "streams": streams,
                         "measure": measure, "values": values[measure]})
    return rows


def rss_rows(rss: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Two rows per model (peak, steady) from peer_matrix's RSS records, in GiB."""
    rows = []
    for model, by_engine in rss.items():
        prompt_len = next(iter(by_engine.values()))["prompt_len"]
        for measure, key in (("peak_rss_gib", "peak_hwm_bytes"), ("steady_rss_gib", "steady_rss_bytes")):
            rows.append({"model": model, "prompt_len": prompt_len, "streams": 1, "measure": measure,
                         "values": {engine: record[key] / GiB for engine, record in by_engine.items()}})
    return rows


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adds each row's advantage and its targets' verdicts; returns every target's summary (worst cell)."""
    for row in rows:
        row["advantage"] = _advantage(row["measure"], row["values"].get("metrale"), row["values"].get("llama.cpp"))
        row["targets"] = [{"label": t.label, "at_least": t.at_least, "strict": t.strict,
                           "met": None if row["advantage"] is None else t.met_by(row["advantage"])}
                          for t in TARGETS if t.applies(row)]
    summaries = []
    for target in TARGETS:
        measured = [r["advantage"] for r in rows if target.applies(r) and r["advantage"] is not None]
        worst = min(measured, default=None)
        summaries.append({**asdict(target), "cells": len(measured), "worst_advantage": worst,
                          "met": None if worst is None else target.met_by(worst),
                          "by": None if worst is None else worst / target.at_least - 1.0})
    return summaries


def result_document(runs: list[dict[str, Any]], rss: Mapping[str, Any], engines: Mapping[str, Any],
                    args: Mapping[str, Any], timing: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON document: date, machine, arguments, engines per model, timing, rows, targets, RSS records, runs."""
    models = list(dict.fromkeys([*(r["model"] for r in runs), *rss]))
    rows = sorted(cell_rows(runs) + rss_rows(rss), key=lambda row: models.index(row["model"]))  # stable: by model
    targets = judge(rows)
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "args": dict(args), "engines": dict(engines), "timing": dict(timing), "rows": rows, "targets": targets,
            "rss": dict(rss), "runs": runs}


def _workload(row: Mapping[str, Any]) -> str:
    if row["measure"] in RSS_MEASURES:
        return f"one {row['prompt_len']}-token prompt"
    return f"{row['prompt_len']} + {row['output_len']}, {row['streams']} stream{'s' * (row['streams'] > 1)}"


def _verdicts(row: Mapping[str, Any]) -> str:
    marks = []
    for t in row["targets"]:
        goal = f"{'>' if t['strict'] else '>='} {t['at_least']:.1f}x"
        marks.append(f"{goal}: {'not measured' if t['met'] is None else 'met' if t['met'] else 'missed'}")
    return "; ".join(marks)


def markdown(document: Mapping[str, Any]) -> str:
    """One table (a row per model, workload and measure), then the targets, then how it ran."""
    number = {"output_tok_s": "{:.1f}", "prompt_tok_s": "{:.1f}", "ttft_p50_s": "{:.2f}", "peak_rss_gib": "{:.2f}",
              "steady_rss_gib": "{:.2f}"}
    lines = ["| model | workload (prompt + output) | measure | metrale | llama.cpp | advantage | target |",
             "|---|---|---|---:|---:|---:|---|"]
    for row in document["rows"]:
        cells = [number[row["measure"]].format(row["values"][e]) if e in row["values"] else "-"
                 for e in ("metrale", "llama.cpp")]
        advantage = "-" if row["advantage"] is None else f"{row['advantage']:.2f}x"
        lines.append(f"| {row['model']} | {_workload(row)} | {MEASURE_NAMES[row['measure']]} | {cells[0]} | "
                     f"{cells[1]} | {advantage} | {_verdicts(row)} |")
    lines += ["", "Advantage > 1: metrale better (tok/s: metrale / llama.cpp; TTFT and RSS: llama.cpp / metrale).",
              "", "Targets (issue 23), on the worst cell each:", ""]
    for t in document["targets"]:
        if t["met"] is None:
            lines.append(f"- {t['label']}: not measured")
        else:
            lines.append(f"- {t['label']}: {'met' if t['met'] else 'MISSED'} ({t['worst_advantage']:.2f}x, "
                         f"{t['by']:+.0%} against the target, {t['cells']} cell{'s' * (t['cells'] > 1)})")
    return "\n".join(lines) + "\n\n" + conditions(document) + "\n"


def conditions(document: Mapping[str, Any]) -> str:
    """How it ran, under the table."""
    m, args, timing = document["machine"], document["args"], document["timing"]
    runs = document["runs"]
    disturbed = sum(len(r.get("disturbed_attempts", ())) for r in runs)
    others = max((r["cpu"]["other"] for r in runs), default=0.0)
    how = "; ".join(f"{model}: " + ", ".join(f"{e} {info.get('transport', '')}".strip() for e, info in engines.items())
                    for model, engines in document["engines"].items())
    return "\n".join([
        f"Greedy, ignore_eos, random token-id prompts, all requests of a cell at t=0, median of {args['rounds']} "
        f"round(s), engines one at a time (the first rotating). {how}.",
        f"Machine: {m['cpu']}, {m['cpu_count']} CPUs, metrale {m['metrale_commit']}. Other processes used at most "
        f"{others:.0%} of the machine during a run; {disturbed} disturbed runs were repeated; token counts as asked "
        f"in every run: {all(r['token_counts_ok'] for r in runs)}.",
        ("" if timing.get("complete", True) else "INCOMPLETE: the run stopped before its end; ")
        + f"Wall time {timing.get('total_s', 0):.0f} s (estimated beforehand: {timing.get('estimate_s', 0):.0f} s); "
        "per model: " + ", ".join(f"{k} {v:.0f} s" for k, v in timing.get("per_model_s", {}).items()) + ".",
    ])


def save(document: Mapping[str, Any], out_dir: Path, name: str) -> list[Path]:
    """<name>.json (per-request inter-token gaps left out) and <name>.md."""
    from metrale.bench.report import write_json

    runs = [{**r, "details": {k: v for k, v in r["details"].items() if k != "itls"}} for r in document["runs"]]
    paths = [write_json(out_dir / f"{name}.json", [{**document, "runs": runs}]), out_dir / f"{name}.md"]
    paths[1].write_text(markdown(document))
    return paths
