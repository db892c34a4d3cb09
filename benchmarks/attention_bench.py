"""Per-layer cost of paged attention on this machine: reference (plain MLX) vs the C++ decode kernel.

    .venv/bin/python benchmarks/attention_bench.py            # default model shape: 9 heads, 3 kv, hd 64
    .venv/bin/python benchmarks/attention_bench.py --layers 30 --repeat 10 --context 256
    .venv/bin/python benchmarks/attention_bench.py --n-heads 32 --n-kv-heads 8 --kv-dtype float16 \
        --prefill-chunks 512x2048 512x8192 --layers 2 --repeat 5 --num-blocks 1100   # the 1B shape, long context

Each timed graph chains `--layers` attention calls (one pool per layer, each layer's queries depend
on the previous output, as in a forward pass) and is evaluated once; the figure is the median wall
time over `--repeat` graphs divided by the layers. Also reports the K/V write and metadata build.
--prefill-chunks QxC ... runs one prefill case per chunk (Q queries ending at context C) instead of the three
default cases; the "gathered" backend is the kernel backend without its paged prefill (gather + matmuls +
fused softmax), the path paged prefill replaced.
METRALE_ATTENTION_THREADS=N sets the kernel's threads (default: the CPUs this process may use).
The decode case also reports the K/V bytes its rows read per layer as GB/s, and with --roof that rate as a
share of the machine's read bandwidth: benchmarks/roofline_probe.c's STREAM-like read of --roof-mib MiB
(above the caches) on the kernel's thread count, measured in the same run. On a shared machine compare
rates from one run (the probe reports wall and per-CPU-time rates; the bench's are wall).
    .venv/bin/python benchmarks/attention_bench.py --n-heads 32 --n-kv-heads 8 --kv-dtype float16 \
        --context 192 --num-decode 32 --layers 16 --num-blocks 512 --decode-only --backend kernel --roof
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
import numpy as np  # noqa: E402

from kernels import ext as _ext  # noqa: E402
from kernels.backend import attention_backend
from kvcache import attention as _attention  # noqa: E402
from kvcache.attention import AttentionMetadata, paged_attention  # noqa: E402
from kvcache import quantized  # noqa: E402
from kvcache.storage import PagedKVCache  # noqa: E402


_has_paged_prefill = _attention.ext.has_paged_prefill


def make_batch(rng, num_decode, context, chunks, block_size, num_blocks):
    """Plain-Python step inputs: decodes at `context`, then (query_len, context_len) prefill chunks."""
    query_lens = [1] * num_decode + [q for q, _ in chunks]
    context_lens = [context] * num_decode + [c for _, c in chunks]
    order = rng.permutation(num_blocks).tolist()  # scattered blocks, as after hours of serving
    tables, used = [], 0
    for ctx in context_lens:
        n = -(-ctx // block_size)
        tables.append(order[used : used + n])
        used += n
    return query_lens, context_lens, tables


def decode_kv_bytes(cache, context_lens, num_decode):
    """Bytes of K and V one layer's decode rows read: every context slot's row in both pools."""
    k_pool, _ = cache.layer(0)
    row = k_pool.shape[1] * k_pool.shape[3] * k_pool.dtype.size  # n_kv rows of one slot
    return 2 * row * sum(context_lens[:num_decode])


def read_roof(threads, mib):
    """The probe's read bandwidth (GB/s, wall and per CPU time) on `threads` threads; None without a compiler."""
    from benchmarks.qmm_roofline import roofs  # noqa: PLC0415  (compiles the probe: only with --roof)

    roof = roofs(_ext.cpu_isa() or "", threads, mib)
    return (roof["read_gbs_wall"], roof["read_gbs_cpu"]) if roof else None


def timed(fn, repeat):
    """Median seconds of one evaluated call: robust to the other tenants of a shared machine."""
    mx.eval(fn())  # warm-up (and lazily built gather indices)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(name, args, num_decode, chunks, backends):
    rng = np.random.default_rng(0)
    bs, hd, n_heads, n_kv = args.block_size, args.head_dim, args.n_heads, args.n_kv_heads
    query_lens, context_lens, tables = make_batch(rng, num_decode, args.context, chunks, bs, args.num_blocks)
    num_tokens = sum(query_lens)
    cache = PagedKVCache(args.layers, args.num_blocks, bs, n_kv, hd, getattr(mx, args.kv_dtype))
    for layer in range(args.layers):  # fill the pools with random data (not timed)
        k_pool, v_pool = cache.layer(layer)
        for pool in (k_pool, v_pool):
            values = mx.random.normal((*pool.shape[:3], hd))  # (num_blocks, n_kv, block_size, hd)
            pool[:] = quantized.quantize(values) if pool.dtype == mx.int8 else values.astype(pool.dtype)
    mx.eval([cache.layer(i) for i in range(args.layers)])
    queries = [mx.random.normal((num_tokens, n_heads, hd)) for _ in range(args.layers)]  # each (T, H, hd)
    new_kv = mx.random.normal((num_tokens, n_kv, hd))  # (T, n_kv, hd)
    mx.eval(queries, new_kv)

    t0 = time.perf_counter()
    for _ in range(args.repeat):
        md = AttentionMetadata.build(query_lens, context_lens, tables, bs)
    build_ms = (time.perf_counter() - t0) / args.repeat * 1e3

    def writes():
        return [cache.write(i, new_kv, new_kv, md.slot_mapping) for i in range(args.layers)]

    write_ms = timed(writes, args.repeat) / args.layers * 1e3
    print(f"{name}: T={num_tokens} tokens, {num_decode} decodes x {args.context} ctx, "
          f"chunks (query_len, context_len) {chunks}")
    print(f"  metadata build {build_ms:.3f} ms/step   K/V write {write_ms:.3f} ms/layer")
    results = {}
    for backend in backends:
        os.environ["METRALE_ATTENTION"] = "kernel" if backend == "gathered" else backend
        _attention.ext.has_paged_prefill = (lambda: False) if backend == "gathered" else _has_paged_prefill
        scale = hd**-0.5

        def forward():
            outs, prev = [], None
            for layer in range(args.layers):
                k_pool, v_pool = cache.layer(layer)
                q = queries[layer] if prev is None else queries[layer] + 1e-3 * prev  # a chain, like a model
                prev = paged_attention(q, k_pool, v_pool, md, scale, args.window)  # (T, H, hd)
                outs.append(prev)
            return outs

        results[backend] = forward()
        ms = timed(forward, args.repeat) / args.layers * 1e3
        rate = ""
        if num_decode and not chunks:
            gbs = decode_kv_bytes(cache, context_lens, num_decode) / ms / 1e6
            rate = f"   K/V read {gbs:5.1f} GB/s" + (f" = {gbs / args.roof_gbs:.0%} of the read roof" if args.roof_gbs else "")
        print(f"  {backend:9s} attention {ms:7.3f} ms/layer   ({ms * 30:.1f} ms per 30-layer step){rate}")
    for other in ("reference", "gathered"):
        if other in results and "kernel" in results:
            diff = max(float(mx.max(mx.abs(a - b))) for a, b in zip(results[other], results["kernel"]))
            print(f"  max |kernel - {other}| = {diff:.2e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--num-decode", type=int, default=32)
    p.add_argument("--n-heads", type=int, default=9)
    p.add_argument("--n-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--window", type=int, default=None)
    p.add_argument("--backend", choices=["reference", "kernel", "both", "gathered", "kernel+gathered"], default="both")
    p.add_argument("--kv-dtype", choices=["float32", "float16", "bfloat16", "int8"], default="float32")
    p.add_argument("--decode-only", action="store_true", help="only the decode case (no mixed, no prefill)")
    p.add_argument("--prefill-chunks", nargs="+", metavar="QxC", help="prefill cases: Q queries ending at context C")
    p.add_argument("--roof", action="store_true", help="measure the read bandwidth (roofline_probe.c) to compare")
    p.add_argument("--roof-mib", type=int, default=1024, help="the read probe's buffer (above the caches)")
    args = p.parse_args(argv)
    args.roof_gbs = None

    has_kernel = _ext.load() is not None
    if args.backend == "kernel" and not has_kernel:
        p.error("the kernel is not built: python -m kernels.build")
    backends = ["reference", "kernel"] if args.backend == "both" and has_kernel else args.backend.split("+")
    if args.backend == "both" and not has_kernel:
        backends = ["reference"]
        print("(kernel not built: reference only)")
    os.environ.pop("METRALE_ATTENTION", None)
    print(f"mlx {mx.__version__}, device {mx.default_device()}, default backend {attention_backend()}, "
          f"{args.layers} layers per graph, {args.repeat} repeats")
    if args.roof:
        threads = int(os.environ.get("METRALE_ATTENTION_THREADS", "0")) or len(os.sched_getaffinity(0))
        roof = read_roof(threads, args.roof_mib)
        if roof is None:
            print("(no C compiler for the read probe: no roof)")
        else:
            args.roof_gbs = roof[0]
            print(f"read roof ({threads} threads, {args.roof_mib} MiB): {roof[0]:.1f} GB/s wall, {roof[1]:.1f} per CPU time")
    if args.prefill_chunks:
        for spec in args.prefill_chunks:
            q, c = map(int, spec.split("x"))
            run_case(f"prefill {q}x{c}", args, 0, [(q, c)], backends)
        return
    run_case("decode", args, args.num_decode, [], backends)
    if args.decode_only:
        return
    run_case("mixed", args, args.num_decode - 4, [(128, 128), (64, 320), (16, 1040), (5, 21)], backends)
    run_case("prefill", args, 0, [(512, 512), (256, 1024)], backends)


if __name__ == "__main__":
    main()
