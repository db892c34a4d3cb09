"""The paged prefill attention kernel alone: GFLOP/s per 512-query chunk at contexts up to 8k, against the
machine's float32 FMA peak.

    .venv/bin/python benchmarks/prefill_attention_bench.py --shape 1b --contexts 512 2048 4096 8192 [--threads 1] \
        [--isa avx512 avx512_amx]

--isa names kernel sets to compare (kernels.ext.supported_isas(); default: the one chosen at load): each
repeat runs every set in turn on the same inputs (A/B alternated, so the shared machine's load hits both
alike); avx512_amx runs the AMX-BF16 kernel (prefill_amx.cpp) for chunks of 16+ queries, avx512 the float32 one.

One chunk of `--chunk` queries ending at each context (the chunk a long prompt's last step runs), float16
pool (or --kv-dtype), block size 16, the model shape's heads. FLOPs counted: 4 * head_dim per
(query head, visible key) pair (QK^T and PV, 2 each per multiply-add); softmax not counted. Rates are per
second of wall time and per second of the process's CPU time (the shared machine's other load shows in the
first, not the second; "per core" divides the CPU-time rate by the threads the kernels use; with two
threads on a busy machine a thread that waits for the other spins, so --threads 1 gives the cleanest
per-core rate). The peak is
measured by benchmarks/fma_probe.c (compiled here with cc): independent FMA chains on 512- and 256-bit
vectors, one thread, its CPU time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kernels, not an installed one

SHAPES = {"1b": (32, 8, 64), "135m": (9, 3, 64), "3b": (24, 8, 128)}  # n_heads, n_kv_heads, head_dim
HERE = Path(__file__).resolve().parent


def fma_peak(has_avx512: bool) -> dict:
    """One core's float32 FMA rate, GFLOP/s, on 256-bit vectors and, where the CPU has AVX-512, 512-bit
    ones (benchmarks/fma_probe.c)."""
    widths = (("zmm", ["-mavx512f"]), ("ymm", ["-mavx2"])) if has_avx512 else (("ymm", ["-mavx2"]),)
    with tempfile.TemporaryDirectory() as tmp:
        peaks = {}
        for name, flags in widths:
            exe = Path(tmp) / name
            subprocess.run(["cc", "-O2", "-mfma", *flags, f"-DWIDTH={512 if name == 'zmm' else 256}",
                            str(HERE / "fma_probe.c"), "-o", str(exe)], check=True)
            peaks[name] = max(json.loads(subprocess.run([str(exe)], capture_output=True, text=True,
                                                        check=True).stdout)["gflops_cpu"] for _ in range(3))
    return peaks


def visible_keys(first: int, q_len: int) -> int:
    """(query, key) pairs a causal chunk of q_len queries at positions first.. sees."""
    return q_len * first + q_len * (q_len + 1) // 2


def bench(shape: str, contexts: list[int], chunk: int, kv_dtype: str, repeat: int, isas: list[str]) -> list[dict]:
    import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)
    import mlx.core as mx

    from kernels import ext

    n_heads, n_kv, hd = SHAPES[shape]
    block = 16
    slots = max(contexts)
    pool_k = mx.random.normal((slots // block, n_kv, block, hd)).astype(getattr(mx, kv_dtype))  # kvcache/storage.py
    pool_v = mx.random.normal((slots // block, n_kv, block, hd)).astype(getattr(mx, kv_dtype))
    table = mx.arange(slots // block, dtype=mx.int32)
    mx.eval(pool_k, pool_v, table)
    rows = []
    for ctx in contexts:
        q_len = min(chunk, ctx)
        q = mx.random.normal((q_len, n_heads, hd))
        mx.eval(q)
        run = lambda: mx.eval(ext.paged_prefill(q, pool_k, pool_v, table, first_position=ctx - q_len,  # noqa: E731
                                                scale=hd**-0.5, block_size=block, window=0))
        walls = {isa: [] for isa in isas}
        cpus = {isa: [] for isa in isas}
        for i in range(repeat + 1):  # the first round warms up
            for isa in isas:
                ext.set_cpu_isa(isa)
                w, c = time.perf_counter(), time.process_time()
                run()
                if i:
                    walls[isa].append(time.perf_counter() - w)
                    cpus[isa].append(time.process_time() - c)
        flops = 4.0 * hd * n_heads * visible_keys(ctx - q_len, q_len)
        for isa in isas:
            rows.append({"context": ctx, "isa": isa, "ms": min(walls[isa]) * 1e3,
                         "gflops_wall": flops / min(walls[isa]) / 1e9, "gflops_cpu": flops / min(cpus[isa]) / 1e9})
    ext.set_cpu_isa("auto")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--kv-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="kernel threads (0: the default, all cores)")
    p.add_argument("--no-peak", action="store_true", help="skip the FMA probe")
    p.add_argument("--isa", nargs="+", default=None, help="kernel sets to compare, alternated (default: the chosen one)")
    args = p.parse_args(argv)
    from kernels import ext

    isas = args.isa or [ext.cpu_isa()]
    unknown = [isa for isa in isas if isa not in ext.supported_isas()]
    if unknown:
        raise SystemExit(f"--isa {unknown}: this machine runs {ext.supported_isas()}")

    if args.threads and not ext.load().set_num_threads(args.threads):
        raise SystemExit(f"could not set {args.threads} kernel threads")
    threads = ext.load().num_threads()
    peak = {} if args.no_peak else fma_peak(any(isa.startswith("avx512") for isa in ext.supported_isas()))
    print(f"shape {args.shape} {SHAPES[args.shape]} kv {args.kv_dtype} threads {threads}; "
          f"FMA peak per core: {peak or 'not measured'} GFLOP/s")
    print(f"{'context':>8s} {'isa':>11s} {'ms':>8s} {'GFLOP/s wall':>13s} {'GFLOP/s cpu':>12s} {'per core':>9s}")
    for r in bench(args.shape, args.contexts, args.chunk, args.kv_dtype, args.repeat, isas):
        print(f"{r['context']:8d} {r['isa']:>11s} {r['ms']:8.3f} {r['gflops_wall']:13.1f} {r['gflops_cpu']:12.1f} "
              f"{r['gflops_cpu'] / threads:9.1f}")


if __name__ == "__main__":
    main()
