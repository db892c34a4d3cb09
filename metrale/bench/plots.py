"""PNG plots of benchmark results (matplotlib, from the `bench` extra, on the Agg backend).

    plot_throughput({"metrale": runs}, "x.png", x="max_concurrency")   # a sweep: tok/s and p99s vs x
    plot_latency_cdfs({"metrale": run, "mlx-lm": other}, "y.png")      # CDFs of TTFT/TPOT/ITL/E2EL
    plot_soak(soak_result, "z.png")                                    # RSS and free KV blocks over time
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def samples_from_details(result: Mapping[str, Any]) -> dict[str, list[float]]:
    """Latency samples in ms of a result's completed requests, rebuilt from its "details"."""
    d = result["details"]
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for ttft, itls, e2el, n, error in zip(d["ttfts"], d["itls"], d["e2els"], d["output_lens"], d["errors"]):
        if error:
            continue
        out["ttft"].append(ttft * 1e3)
        out["e2el"].append(e2el * 1e3)
        out["itl"].extend(x * 1e3 for x in itls)
        if n > 1:
            out["tpot"].append((e2el - ttft) / (n - 1) * 1e3)
    return out


def _x_value(result: Mapping[str, Any], x: str) -> float:
    value = result.get(x)
    if value in (None, "inf"):
        return math.inf if x == "request_rate" else float(result["num_prompts"])
    return float(value)


def plot_throughput(series: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                    x: str = "max_concurrency", title: str = "") -> Path:
    """Output throughput and p99 TTFT / ITL against `x` (max_concurrency or request_rate), one line per series."""
    plt = _pyplot()
    fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
    for label, runs in series.items():
        runs = sorted(runs, key=lambda r: _x_value(r, x))
        xs = [_x_value(r, x) for r in runs]
        finite = [v for v in xs if math.isfinite(v)]
        xs = [v if math.isfinite(v) else (max(finite, default=1.0) * 1.5) for v in xs]  # inf drawn at the right
        ax_tput.plot(xs, [r["output_throughput"] for r in runs], "o-", label=label)
        ax_lat.plot(xs, [r["p99_ttft_ms"] for r in runs], "o-", label=f"{label} p99 TTFT")
        ax_lat.plot(xs, [r["p99_itl_ms"] for r in runs], "s--", label=f"{label} p99 ITL")
    xlabel = {"max_concurrency": "max concurrency (requests in flight)", "request_rate": "request rate (req/s)"}
    for ax in (ax_tput, ax_lat):
        ax.set_xlabel(xlabel.get(x, x))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tput.set_ylabel("output tokens / s")
    ax_tput.set_ylim(bottom=0)
    ax_lat.set_ylabel("ms")
    ax_lat.set_yscale("log")
    fig.suptitle(title or "throughput")
    return _save(fig, path)


def plot_latency_cdfs(series: Mapping[str, Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2EL (ms), one line per series."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
    for label, result in series.items():
        samples = samples_from_details(result)
        for ax, (metric, name) in zip(axes.flat, names.items()):
            values = np.sort(np.asarray(samples[metric]))
            if values.size:
                fractions = np.arange(0, values.size + 1) / values.size  # from 0 at the smallest sample
                ax.step(np.concatenate([values[:1], values]), fractions, where="post",
                        label=f"{label} (p99 {np.percentile(values, 99):.0f} ms)")
            ax.set_title(name)
    for ax in axes.flat:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "latency distributions")
    return _save(fig, path)


def plot_soak(result: Mapping[str, Any], path: str | Path) -> Path:
    """RSS (MiB) and free KV blocks over the soak, idle windows shaded."""
    plt = _pyplot()
    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, (ax_rss, ax_kv) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax_rss.plot(t, [s["rss_mib"] for s in samples], label="RSS")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_kv.plot(t, [s["kv_blocks_free"] for s in samples], color="tab:green", label="free KV blocks")
    ax_kv.plot(t, [s["running"] for s in samples], color="tab:orange", alpha=0.6, label="running requests")
    ax_kv.axhline(result["baseline"]["kv_blocks_free"], color="gray", ls=":", label="baseline free blocks")
    ax_kv.set_ylabel("count")
    ax_kv.set_xlabel("s since start")
    for idle in result["idle_checks"]:
        for ax in (ax_rss, ax_kv):
            ax.axvspan(idle["t_start"], idle["t"], color="gray", alpha=0.15)
    for ax in (ax_rss, ax_kv):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"soak: {result['verdict']} ({result['cancelled']} of {result['requests']} cancelled)")
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
