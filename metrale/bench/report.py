"""The console table (laid out like vLLM bench's "Serving Benchmark Result") and the JSON file.

One run is written as one flat JSON object of vLLM's field names; a sweep as {"runs": [...]}, each
element such an object. Per-request lists are kept under "details".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from metrale.bench.stats import LATENCY_METRICS

_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
_WIDTH = 50


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40}{value:>10}"


def _percentile_keys(result: dict[str, Any], metric: str) -> list[str]:
    return [k for k in result if k.startswith("p") and k.endswith(f"_{metric}_ms")]


def format_result(result: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A result dict as the console table."""
    lines = [f" {title} ".center(_WIDTH, "="),
             _row("Backend:", str(result.get("backend", ""))),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"])]
    if result.get("cancelled"):
        lines.append(_row("Cancelled requests:", result["cancelled"]))
    concurrency = result.get("max_concurrency")
    rate = result.get("request_rate", "inf")
    lines += [_row("Request rate (req/s):", rate if isinstance(rate, str) else f"{rate:.3g}"),
              _row("Maximum request concurrency:", concurrency if concurrency is not None else "-"),
              _row("Benchmark duration (s):", result["duration"]),
              _row("Total input tokens:", result["total_input_tokens"]),
              _row("Total generated tokens:", result["total_output_tokens"]),
              _row("Prompt tokens from the prefix cache:",
                   f"{result.get('total_cached_tokens', 0)} ({result.get('prefix_cache_hit_rate', 0.0):.0%})"),
              _row("Request throughput (req/s):", result["request_throughput"])]
    if "request_goodput" in result:
        slos = " ".join(f"{k}:{v:g}" for k, v in result["goodput_slos_ms"].items())
        lines += [_row("Goodput SLOs (ms):", slos),
                  _row("Request goodput (req/s):", result["request_goodput"]),
                  _row("Requests meeting all SLOs:",
                       f"{result['good_requests']} ({result['request_goodput_ratio']:.0%})")]
    lines += [_row("Output token throughput (tok/s):", result["output_throughput"]),
              _row("Total token throughput (tok/s):", result["total_token_throughput"])]
    for metric in LATENCY_METRICS:
        upper = metric.upper()
        lines.append(f" {_TITLES[metric]} ".center(_WIDTH, "-"))
        lines.append(_row(f"Mean {upper} (ms):", result[f"mean_{metric}_ms"]))
        lines.append(_row(f"Median {upper} (ms):", result[f"median_{metric}_ms"]))
        for key in _percentile_keys(result, metric):
            lines.append(_row(f"P{key[1:].split('_')[0]} {upper} (ms):", result[key]))
    lines.append("=" * _WIDTH)
    errors = [e for e in result.get("details", {}).get("errors", []) if e and e != "cancelled"]
    if errors:
        lines.append(f"first error ({len(errors)} failed): {errors[0][:300]}")
    return "\n".join(lines)


def format_sweep(results: Sequence[dict[str, Any]]) -> str:
    """One line per run of a sweep: the settings, throughput (and goodput) and the p99 latencies."""
    with_goodput = any("request_goodput" in r for r in results)
    header = (f"{'rate':>8} {'conc':>5} {'ok':>4} {'fail':>4} {'req/s':>7} "
              + (f"{'good req/s':>10} {'good':>5} " if with_goodput else "")
              + f"{'out tok/s':>10} {'p99 TTFT ms':>12} {'p99 TPOT ms':>12} {'p99 ITL ms':>11} {'p99 E2EL ms':>12}")
    lines = [header]
    for r in results:
        conc = r.get("max_concurrency")
        rate = r["request_rate"]
        good = (f"{r.get('request_goodput', 0.0):>10.2f} {r.get('request_goodput_ratio', 0.0):>5.0%} "
                if with_goodput else "")
        lines.append(f"{rate if isinstance(rate, str) else format(rate, '.3g'):>8} {str(conc if conc is not None else '-'):>5} "
                     f"{r['completed']:>4} {r['failed']:>4} {r['request_throughput']:>7.2f} {good}"
                     f"{r['output_throughput']:>10.1f} {r.get('p99_ttft_ms', 0.0):>12.0f} "
                     f"{r.get('p99_tpot_ms', 0.0):>12.0f} {r.get('p99_itl_ms', 0.0):>11.0f} "
                     f"{r.get('p99_e2el_ms', 0.0):>12.0f}")
    return "\n".join(lines)


def format_comparison(pairs: Sequence[tuple[dict[str, Any], dict[str, Any]]], names: tuple[str, str]) -> str:
    """One line per setting of a two-server comparison: each side's output throughput and latencies, and B / A."""
    a, b = names
    lines = [f"A = {a}", f"B = {b}",
             f"{'setting':<28} {'A out tok/s':>11} {'B out tok/s':>11} {'B/A':>6} {'A p50 TTFT':>10} {'B p50 TTFT':>10} "
             f"{'B/A':>6} {'A p50 TPOT':>10} {'B p50 TPOT':>10} {'B/A':>6}"]
    for first, second in pairs:
        setting = first.get("label", "")[-28:]
        cells = []
        for key in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            x, y = first.get(key, 0.0), second.get(key, 0.0)
            width = 11 if key == "output_throughput" else 10
            cells.append(f"{x:>{width}.1f} {y:>{width}.1f} {(y / x if x else float('nan')):>6.2f}")
        lines.append(f"{setting:<28} " + " ".join(cells))
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str | Path, results: Sequence[dict[str, Any]], metadata: dict[str, Any] | None = None) -> Path:
    """Write one run flat, or several as {"runs": [...]}, with optional metadata; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(results) == 1:
        payload: dict[str, Any] = {**(metadata or {}), **results[0]}
    else:
        payload = {**(metadata or {}), "runs": list(results)}
    path.write_text(json.dumps(_jsonable(payload), indent=1) + "\n")
    return path
