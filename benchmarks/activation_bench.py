"""Cost of the MLP's gated activation, act(gate) * up: the MLX expression vs the fused C++ kernel.

    .venv/bin/python benchmarks/activation_bench.py                    # (32, 1536) and (512, 1536), float32
    .venv/bin/python benchmarks/activation_bench.py --rows 1 32 128 512 --dtype bfloat16 --repeat 21

The default shapes are SmolLM2-135M's (intermediate 1536): 32 rows is a decode step of 32 tokens,
512 a prefill chunk. Each figure is the wall time of 30 calls (30 layers, distinct inputs), each
evaluated on its own, in ms: the median over `--repeat` trials and, in parentheses, the fastest
(the machine is shared). Each call includes mx.eval's own overhead (~10 us; a plain multiply of
(32, 1536) costs ~12 us). The kernel goes through kernels.activations.gated_activation (with
METRALE_KERNELS=kernel). METRALE_ATTENTION_THREADS=N sets the kernel's threads (default:
the CPUs this process may use); inputs below 2^18 elements run on one thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from kernels.activations import gated_activation
from kernels.backend import activation_backend  # noqa: E402

CALLS = 30
MLX_EXPR = {
    "silu": lambda g, u: nn.silu(g) * u,
    "gelu_pytorch_tanh": lambda g, u: nn.gelu_approx(g) * u,
}


def timed_ms(fn, gates, ups, repeat: int) -> tuple[float, float]:
    """(median, min) ms of CALLS calls fn(gates[i], ups[i]), each evaluated on its own."""

    def trial() -> float:
        start = time.perf_counter()
        for g, u in zip(gates, ups):
            mx.eval(fn(g, u))
        return (time.perf_counter() - start) * 1e3

    trial()  # warm-up: allocator caches, pool threads, compiled nn.silu
    times = [trial() for _ in range(repeat)]
    return statistics.median(times), min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 512], help="rows of (rows, width)")
    parser.add_argument("--width", type=int, default=1536, help="the MLP's intermediate size")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--repeat", type=int, default=11, help="trials per figure (median)")
    args = parser.parse_args(argv)

    os.environ["METRALE_KERNELS"] = "kernel"  # RuntimeError if the kernel is not built / not on CPU
    activation_backend()
    dtype = getattr(mx, args.dtype)
    threads = os.environ.get("METRALE_ATTENTION_THREADS", f"{len(os.sched_getaffinity(0))} (all CPUs)")
    print(f"mlx {mx.__version__}, {args.dtype}, kernel threads {threads}; ms per {CALLS} calls, median of "
          f"{args.repeat}")
    print(f"{'kind':<18} {'shape':<12} {'mlx expr':>17} {'kernel':>15} {'speedup':>8}")
    for rows in args.rows:
        shape = (rows, args.width)
        keys = mx.random.split(mx.random.key(0), 2 * CALLS)
        gates = [(mx.random.normal(shape, key=k) * 3).astype(dtype) for k in keys[:CALLS]]
        ups = [mx.random.normal(shape, key=k).astype(dtype) for k in keys[CALLS:]]
        mx.eval(gates, ups)
        for kind, expr in MLX_EXPR.items():
            fused = lambda g, u, kind=kind: gated_activation(g, u, kind)  # noqa: E731
            ref, ref_min = timed_ms(expr, gates, ups, args.repeat)
            fast, fast_min = timed_ms(fused, gates, ups, args.repeat)
            print(f"{kind:<18} {str(shape):<12} {ref:8.2f} ({ref_min:6.2f}) {fast:6.2f} ({fast_min:6.2f}) "
                  f"{ref / fast:7.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
