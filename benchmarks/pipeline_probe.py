"""Would preparing step n+1 while step n runs pay at one stream? A bare greedy decode loop on the
default model, sequential (build the graph, evaluate, read the token) vs pipelined (step n+1's graph
built on step n's lazy argmax and queued before step n's token is read), alternating, same tokens.

    .venv/bin/python benchmarks/pipeline_probe.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels.runtime  # noqa: E402,F401  # the OpenBLAS preload, before mlx

import mlx.core as mx  # noqa: E402
from kvcache.attention import AttentionMetadata  # noqa: E402
from metrale.config import EngineConfig  # noqa: E402
from metrale.engine.runner import ModelRunner  # noqa: E402


def forward(runner: ModelRunner, token: mx.array, position: int) -> mx.array:
    """One greedy decode of `token` (1,) at `position` in a 40-block table: the lazy next token (1,)."""
    md = AttentionMetadata.build([1], [position + 1], [tuple(range(40))], runner.kv_cache.block_size,
                                 backend=runner.backends.attention)
    h = runner.model(token, md.positions, runner.kv_cache, md)
    return mx.argmax(runner.model.compute_logits(h), axis=-1).astype(mx.int32)

def sequential(runner: ModelRunner, n: int, start: int = 128) -> tuple[float, list[int]]:
    """Build, evaluate, read: the engine's order today. Returns (seconds, tokens)."""
    token, tokens = mx.array([100], dtype=mx.int32), []
    t0 = time.perf_counter()
    for i in range(n):
        next_token = forward(runner, token, start + i)
        mx.async_eval(next_token, runner._pools())
        tokens.append(next_token.item())
        token = mx.array(tokens[-1:], dtype=mx.int32)
    return time.perf_counter() - t0, tokens


def pipelined(runner: ModelRunner, n: int, start: int = 128) -> tuple[float, list[int]]:
    """Step i+1 built on step i's lazy token and queued before step i's token is read."""
    t0 = time.perf_counter()
    tokens = []
    pending = forward(runner, mx.array([100], dtype=mx.int32), start)
    mx.async_eval(pending, runner._pools())
    for i in range(n):
        following = None
        if i + 1 < n:
            following = forward(runner, pending, start + i + 1)
            mx.async_eval(following, runner._pools())
        tokens.append(pending.item())
        pending = following
    return time.perf_counter() - t0, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runner = ModelRunner.load(EngineConfig())
    for _ in range(args.rounds):
        ts, a = sequential(runner, args.tokens)
        tp, b = pipelined(runner, args.tokens)
        print(f"sequential {args.tokens / ts:.1f} tok/s  pipelined {args.tokens / tp:.1f} tok/s  same tokens: {a == b}")


if __name__ == "__main__":
    main()
