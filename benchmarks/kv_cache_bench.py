"""The KV cache's dtype and long contexts, at the attention op: bytes per token, prefill chunk attention
and decode attention per layer, float32 vs 16-bit vs int8 (q8 rows) pools, the gathered matmul path vs the
paged prefill kernel.

    .venv/bin/python benchmarks/kv_cache_bench.py                       # 135M and 1B shapes
    .venv/bin/python benchmarks/kv_cache_bench.py --shapes 135m --contexts 512 8192 --repeat 5

Per case the variants run alternately, round after round (`--repeat` rounds), and the median of each
is reported: the machine is shared, so a burst of load hits every variant alike. One timed call chains
`--layers` layers (each layer's queries depend on the previous output, as in a forward pass).
  prefill  one chunk of `--chunk` queries at the end of a context of N tokens (N = chunk: a prompt's
           first chunk), per layer. "gathered f32" is the path before the paged prefill kernel
           (gather the visible rows, two matmuls around the fused causal softmax, float32 pools).
  decode   `--batch` sequences of one query each at a context of `--decode-context` tokens, per layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401,E402  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from kernels import ext  # noqa: E402
from kvcache import attention  # noqa: E402
from kvcache.attention import AttentionMetadata, paged_attention  # noqa: E402
from kvcache import quantized  # noqa: E402
from kvcache.storage import PagedKVCache  # noqa: E402

# name: (layers, n_heads, n_kv_heads, head_dim), as the real models
SHAPES = {"135m": (30, 9, 3, 64), "1b": (16, 32, 8, 64)}
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16, "int8": mx.int8}


def kv_bytes_per_token(shape, dtype) -> int:
    layers, _, n_kv, hd = shape
    return PagedKVCache.bytes_per_block(layers, 1, n_kv, hd, dtype)


def make_pools(layers, num_blocks, block_size, n_kv, hd, dtype):
    cache = PagedKVCache(layers, num_blocks, block_size, n_kv, hd, dtype)
    pools = []
    for layer in range(layers):
        k_pool, v_pool = cache.layer(layer)
        pools.append((random_rows(k_pool.shape, hd, dtype), random_rows(v_pool.shape, hd, dtype)))
    mx.eval(pools)
    return pools


def random_rows(pool_shape, head_dim, dtype) -> mx.array:
    """A pool of `pool_shape` holding standard normal head vectors: int8 pools as real q8 rows (valid
    float16 scales, kvcache/quantized.py), float pools as the values themselves."""
    if dtype == mx.int8:
        return quantized.quantize(mx.random.normal((*pool_shape[:-1], head_dim)))
    return mx.random.normal(pool_shape).astype(dtype)


def chained(pools, queries, md, scale, chunk_fn=None):
    """One forward's attention over `pools`: layer l's queries lean on layer l-1's output."""
    def run():
        outs, prev = [], None
        for (k_pool, v_pool), q in zip(pools, queries):
            q = q if prev is None else q + 1e-3 * prev
            prev = chunk_fn(q, k_pool, v_pool) if chunk_fn else paged_attention(q, k_pool, v_pool, md, scale)
            outs.append(prev)
        return outs
    return run


def alternate(variants: dict, repeat: int) -> dict[str, float]:
    """Median seconds per variant, run round-robin `repeat` times after one warm-up each."""
    for fn in variants.values():
        mx.eval(fn())
    times = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def prefill_case(shape, context, args):
    _, n_heads, n_kv, hd = shape
    layers, bs, chunk = args.layers, args.block_size, min(args.chunk, context)
    num_blocks = -(-context // bs) + 1
    table = np.random.default_rng(0).permutation(num_blocks)[: -(-context // bs)].tolist()  # scattered blocks
    md = AttentionMetadata.build([chunk], [context], [table], bs, backend="kernel")
    scale = hd**-0.5
    queries = [mx.random.normal((chunk, n_heads, hd)) for _ in range(layers)]  # each (chunk, H, hd)
    mx.eval(queries)
    variants = {}
    for name in args.dtypes:
        pools = make_pools(layers, num_blocks, bs, n_kv, hd, DTYPES[name])
        if name == "f32":
            def gathered(q, k, v, md=md):
                return attention._chunk_gathered(q, k, v, md, md.chunks[0], scale, None, True)
            variants["gathered f32"] = chained(pools, queries, md, scale, gathered)
        variants[f"kernel {name}"] = chained(pools, queries, md, scale)
    medians = alternate(variants, args.repeat)
    row = "  ".join(f"{n} {s / layers * 1e3:8.2f} ms" for n, s in medians.items())
    print(f"  prefill chunk {chunk:4d} @ context {context:5d}: {row}  per layer", flush=True)


def decode_case(shape, args):
    _, n_heads, n_kv, hd = shape
    layers, bs, ctx, batch = args.layers, args.block_size, args.decode_context, args.batch
    per_seq = -(-ctx // bs)
    num_blocks = per_seq * batch + 1
    order = np.random.default_rng(1).permutation(num_blocks).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    md = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, bs, backend="kernel")
    queries = [mx.random.normal((batch, n_heads, hd)) for _ in range(layers)]  # each (B, H, hd)
    mx.eval(queries)
    variants = {name: chained(make_pools(layers, num_blocks, bs, n_kv, hd, DTYPES[name]), queries, md, hd**-0.5)
                for name in args.dtypes}
    medians = alternate(variants, args.repeat)
    row = "  ".join(f"{n} {s / layers * 1e3:7.3f} ms" for n, s in medians.items())
    print(f"  decode {batch} x context {ctx}: {row}  per layer", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--dtypes", nargs="+", default=["f32", "f16"], choices=list(DTYPES))
    p.add_argument("--layers", type=int, default=4, help="layers chained per timed call")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    if not ext.has_paged_prefill():
        p.error("the kernels with paged_prefill are not built: python -m kernels.build")
    print(f"mlx {mx.__version__}, kernels {ext.cpu_isa()}, {args.layers} layers per call, "
          f"{args.repeat} alternating rounds, median")
    for name in args.shapes:
        shape = SHAPES[name]
        sizes = ", ".join(f"{d} {kv_bytes_per_token(shape, DTYPES[d]) / 1024:.1f} KiB" for d in DTYPES)
        print(f"{name}: {shape[0]} layers, {shape[1]} heads, {shape[2]} kv heads, head_dim {shape[3]}; "
              f"KV bytes per token: {sizes}")
        for context in args.contexts:
            prefill_case(shape, context, args)
        decode_case(shape, args)


if __name__ == "__main__":
    main()
