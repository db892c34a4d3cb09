"""Where one decode step's time goes, measured in one run (so ratios hold on a noisy machine).

    .venv/bin/python benchmarks/step_profile.py --batch 32 --context 256

Times, for the default model: the full runner step at `--batch` decodes of `--context` tokens,
the model's weight matmuls alone for the same tokens (the matmul-only bound), and attention alone.
"""

from __future__ import annotations

import argparse
import json
import time

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402

from kernels.backend import attention_backend
from kvcache.attention import AttentionMetadata, paged_attention  # noqa: E402
from metrale.config import EngineConfig  # noqa: E402
from metrale.engine.runner import ModelRunner, SamplingRow, StepInput  # noqa: E402
from metrale.sampling_params import SamplingParams  # noqa: E402
from scheduler import ScheduledRequest, SchedulerOutput  # noqa: E402


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def decode_step(runner: ModelRunner, batch: int, context: int) -> StepInput:
    bs = runner.kv_cache.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    scheduled = []
    for s in range(batch):
        table = tuple(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        scheduled.append(ScheduledRequest(f"r{s}", (100 + s,), context, table, True))
    out = SchedulerOutput(tuple(scheduled), batch, (), bs)
    params = SamplingParams(temperature=0, max_tokens=1)
    rows = tuple(SamplingRow(f"r{s}", params, (1,) * context, ()) for s in range(batch))
    return StepInput(out, rows)


def matmul_bound(runner: ModelRunner, batch: int) -> float:
    """Every weight matmul of one forward (all layers + lm_head) on `batch` token rows."""
    weights = [w for _, w in _linear_weights(runner.model)]
    x = {w.shape[1]: mx.random.normal((batch, w.shape[1])) for w in weights}
    mx.eval(list(x.values()))

    def run():
        mx.eval([x[w.shape[1]] @ w.T for w in weights])
    return best_of(run, 5)


def _linear_weights(model):
    from mlx.utils import tree_flatten
    for name, w in tree_flatten(model.parameters()):
        if w.ndim == 2 and ("proj" in name or "embed_tokens" in name or "lm_head" in name):
            yield name, w


def attention_only(runner: ModelRunner, batch: int, context: int) -> float:
    mc = runner.model_config
    bs = runner.kv_cache.block_size
    blocks = -(-(context + 1) // bs)
    md = AttentionMetadata.build([1] * batch, [context + 1] * batch,
                                 [list(range(s * blocks, (s + 1) * blocks)) for s in range(batch)], bs)
    q = mx.random.normal((batch, mc.num_attention_heads, mc.head_dim))
    k, v = runner.kv_cache.layer(0)

    def run():
        mx.eval([paged_attention(q, k, v, md, mc.head_dim ** -0.5) for _ in range(mc.num_hidden_layers)])
    return best_of(run, 5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    runner = ModelRunner.load(EngineConfig(kv_cache_bytes=512 << 20))
    step = decode_step(runner, args.batch, args.context)
    full = best_of(lambda: runner.execute(step), 5)
    bound = matmul_bound(runner, args.batch)
    attn = attention_only(runner, args.batch, args.context)
    result = {"batch": args.batch, "context": args.context, "attention_backend": attention_backend(),
              "step_s": round(full, 4), "matmul_bound_s": round(bound, 4), "attention_s": round(attn, 4),
              "bound_over_step": round(bound / full, 3), "attention_share": round(attn / full, 3)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
