"""The quantized matmul kernels against the machine's roofs, on Llama-3.2-1B- or 3B-shaped matrices.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/qmm_roofline.py                      # 1B shapes, T = 1 8 32 128 512
    PYTHONPATH=$PWD .venv/bin/python benchmarks/qmm_roofline.py --shape 3b --tokens 1 8 32
    PYTHONPATH=$PWD .venv/bin/python benchmarks/qmm_roofline.py --tokens 1 --threads 1 --clock cpu
    PYTHONPATH=$PWD .venv/bin/python benchmarks/qmm_roofline.py --tokens 1 --pages ab --rounds 4

Roofs (benchmarks/roofline_probe.c, compiled here with the system C compiler and run with the same thread
count): the int8 dot-product peak (a tight loop of independent vpdpbusd, or AVX2's vpmaddubsw +
vpaddw) and the read bandwidth (a STREAM-like sum over a buffer larger than the caches, --buffer-mib).

Matrices: random Q4_0-style 4-bit weights, group 32, float16 scales, packed as the loader packs them:
(N, K) = (2048, 2048) q/o, (8192, 2048) gate or up, (2048, 8192) down; --shape 3b: (3072, 3072) q/o,
(1024, 3072) k/v, (8192, 3072) gate or up, (3072, 8192) down. For each matrix and T:
  ms        median wall (or --clock cpu: the process's CPU) time of one call, over --repeat
  GFLOP/s   2 N K T / time (int16 activations run two int8 dot products per multiply-add: the peak
            for them is half the int8 peak)
  GB/s      packed weight bytes (q + scales + biases) / time: at T = 1 the decode's read rate
  best      GB/s of the fastest call (the read probe reports its fastest of 5 passes: compare these on a
            busy machine)
Each matrix is held in enough copies to fill --model-mib (a 1B model's weights are ~600 MiB) and every
call takes the next copy, so the weights come from memory as a decode step's do, not from the caches.
At T <= 8 one timed evaluation runs every copy back to back in one graph, as a decode step runs its
layers (the kernel threads stay awake between calls; Python's per-call overhead is not timed), and
its time is divided by the copies. The weights sit on huge pages as the loader puts them (--pages huge,
ext.huge_page_copy); --pages ab holds a second set on MLX's own 4 KiB pages and alternates the two
per round (--rounds), so both see the same minutes of a shared machine.
Prints one table; --out writes the rows and the roofs as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.qmm_bench import CLOCK, timed  # noqa: E402
from kernels import ext  # noqa: E402
from kernels.runtime import mx  # noqa: E402

SHAPES = {
    "1b": {"q/o 2048x2048": (2048, 2048), "gate|up 8192x2048": (8192, 2048), "down 2048x8192": (2048, 8192)},
    # Llama-3.2-3B: hidden 3072, 24 / 8 heads of 128 (k/v 1024 rows), ffn 8192
    "3b": {"q/o 3072x3072": (3072, 3072), "k/v 1024x3072": (1024, 3072), "gate|up 8192x3072": (8192, 3072),
           "down 3072x8192": (3072, 8192)},
}
PROBE = Path(__file__).with_name("roofline_probe.c")
ISA_FLAGS = {"avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vnni"], "avx2": ["-mavx2", "-mfma"]}


def roofs(isa: str, threads: int, buffer_mib: int) -> dict:
    """The probe's JSON (int8 peak GOP/s and read GB/s, wall and per-thread CPU time), {} without a compiler."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    isa = "avx512" if isa.startswith("avx512") else isa  # avx512_amx: the same VNNI probe
    if cc is None or isa not in ISA_FLAGS:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "probe"
        subprocess.run([cc, "-O2", "-fopenmp", *ISA_FLAGS[isa], str(PROBE), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe), str(threads), str(buffer_mib)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def random_packed(n: int, k: int, seed: int, huge_pages: bool) -> tuple[mx.array, mx.array, mx.array]:
    """A (N, K) 4-bit group-32 weight already in the kernels' layout: q (N/16, 16 K / 2) uint8, scales and
    biases (N/16, K/32, 16) float16 (random bytes are a valid packing of random nibbles); huge_pages: moved
    to huge pages as the loader places them (kernels.qmm.pack_layers)."""
    key = mx.random.key(seed)
    q = mx.random.randint(0, 256, (n // 16, 8 * k), dtype=mx.int32, key=key).astype(mx.uint8)
    scales = (mx.random.uniform(0.001, 0.01, (n // 16, k // 32, 16), key=key)).astype(mx.float16)
    biases = (-8 * scales).astype(mx.float16)
    mx.eval(q, scales, biases)
    if huge_pages:
        return tuple(ext.huge_page_copy(a) for a in (q, scales, biases))
    return q, scales, biases


def time_matrix(copies: list, x: mx.array, n: int, t: int, args, clock) -> tuple[float, float]:
    """(median, fastest) seconds of one call of x (T, K) by the (N, K) matrix, each call on the next copy."""
    turn = iter(range(1 << 30))
    per_eval = len(copies) if t <= 8 else 1

    def call():
        outs = []
        for _ in range(per_eval):
            q, s, b = copies[next(turn) % len(copies)]
            outs += ext.quantized_matmul(x, q, s, b, bits=4, group_size=32, columns=[n],
                                         activation_bits=args.activations)
        mx.eval(outs)

    return tuple(v * 1e-3 / per_eval for v in timed(call, args.repeat, clock))  # ms -> s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="Llama-3.2-1B or -3B matrices")
    parser.add_argument("--isa", default=None, help="kernel set (scalar, avx2, avx512; default: the best one)")
    parser.add_argument("--activations", type=int, choices=(8, 12, 16), default=16)
    parser.add_argument("--pages", choices=("huge", "mlx", "ab"), default="huge",
                        help="the weights on huge pages as the loader puts them (ext.huge_page_copy), on MLX's "
                             "own allocation (4 KiB pages), or both, alternated per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of --repeat calls per matrix (and variant)")
    parser.add_argument("--threads", type=int, default=None, help="kernel threads (METRALE_ATTENTION_THREADS)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    parser.add_argument("--buffer-mib", type=int, default=1024, help="the read probe's buffer (above the caches)")
    parser.add_argument("--model-mib", type=int, default=640, help="copies of each matrix fill this much")
    parser.add_argument("--no-roofs", action="store_true", help="skip the probe")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads is not None:
        os.environ["METRALE_ATTENTION_THREADS"] = str(args.threads)  # read once, at the first kernel call
    if ext.load() is None or not ext.has_qmm_kernels():
        sys.exit("the CPU kernels are not built: python -m kernels.build")
    threads = args.threads or len(os.sched_getaffinity(0))
    if args.isa:
        ext.set_cpu_isa(args.isa)
    isa = ext.cpu_isa()
    roof = {} if args.no_roofs else roofs(isa, threads, args.buffer_mib)
    if roof:
        print(f"roofs ({threads} threads, {roof['isa']}): int8 peak {roof['int8_gops_cpu']:.0f} GOP/s per CPU "
              f"time ({roof['int8_gops_wall']:.0f} wall); read {roof['read_gbs_cpu']:.1f} GB/s per CPU time "
              f"({roof['read_gbs_wall']:.1f} wall), on huge pages {roof['read_huge_gbs_cpu']:.1f} "
              f"({roof['read_huge_gbs_wall']:.1f}), {args.buffer_mib} MiB buffer")
    clock = CLOCK[args.clock]
    rows = []
    shapes = SHAPES[args.shape]
    variants = ["huge", "mlx"] if args.pages == "ab" else [args.pages]
    weights = {v: {} for v in variants}
    for v in variants:
        for i, (name, (n, k)) in enumerate(shapes.items()):
            copies = max(1, -(-args.model_mib * 2**20 // (n * k * 9 // 16)))  # 4.5 bits per weight
            weights[v][name] = [random_packed(n, k, 1000 * i + c, v == "huge") for c in range(copies)]
    huge = ext.anon_huge_page_bytes()
    print(f"kernels {isa}, int{args.activations} activations, {threads} threads, {args.clock} clock, "
          f"median of {args.repeat} x {args.rounds} rounds; weights on {' / '.join(variants)} pages (huge: "
          f"ext.huge_page_copy, mlx: MLX's allocation), process on huge pages: {huge / 2**20:.0f} MiB")
    print(f"{'matrix':>20} {'pages':>5} {'T':>5} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>7} {'best':>7}")
    for t in args.tokens:
        for name, (n, k) in shapes.items():
            x = mx.random.normal((t, k))
            mx.eval(x)
            times = {v: [] for v in variants}
            for _ in range(args.rounds):  # the variants alternate: the same minutes of a shared machine
                for v in variants:
                    times[v].append(time_matrix(weights[v][name], x, n, t, args, clock))
            for v in variants:
                sec = statistics.median(m for m, _ in times[v])
                fastest = min(f for _, f in times[v])
                nbytes = sum(a.nbytes for a in weights[v][name][0])
                row = {"matrix": name, "pages": v, "tokens": t, "ms": sec * 1e3, "gflops": 2 * n * k * t / sec * 1e-9,
                       "gbs": nbytes / sec * 1e-9, "gbs_best": nbytes / fastest * 1e-9}
                rows.append(row)
                print(f"{name:>20} {v:>5} {t:5d} {row['ms']:9.3f} {row['gflops']:8.1f} {row['gbs']:7.2f} "
                      f"{row['gbs_best']:7.2f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "roofs": roof,
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
