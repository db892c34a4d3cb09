"""The quantized matmul at prompt-chunk sizes per kernel set and activation precision, A/B in one run.

    PYTHONPATH=$PWD METRALE_ATTENTION_THREADS=1 .venv/bin/python benchmarks/qmm_amx_bench.py --tokens 16 64 128 512
    PYTHONPATH=$PWD METRALE_ATTENTION_THREADS=2 .venv/bin/python benchmarks/qmm_amx_bench.py --wall

The Llama-3.2-1B shapes of benchmarks/qmm_roofline.py (random 4-bit group-32 weights, float16 scales:
2048x2048 q/o, 8192x2048 gate or up, 2048x8192 down). For each shape and T, every variant (--variants,
kernel set/activation bits) runs once per repeat in turn, so that the machine's load hits them alike; the
table gives GFLOP/s (2 N K T per second) of the median process CPU time (one call; with
METRALE_ATTENTION_THREADS=1 that is one core's work; --wall: of the wall-clock time, for several
threads). The weights stay in the caches between calls at these T, so this is the compute rate, not the
decode's read rate. Also the AMX peak of one core and its overlap with AVX-512 fmas
(benchmarks/amx_probe.c, compiled here) where the CPU has AMX.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.qmm_roofline import SHAPES, random_packed  # noqa: E402
from kernels import ext  # noqa: E402
from kernels.runtime import mx  # noqa: E402

PROBE = Path(__file__).with_name("amx_probe.c")


def amx_peak() -> dict:
    """amx_probe's JSON, or {} without AMX or a compiler that knows -mamx-int8 and -mavx512f."""
    cc = shutil.which("cc")
    if cc is None or "avx512_amx" not in ext.supported_isas():
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "amx_probe"
        flags = ["-O2", "-mavx512f", "-mamx-tile", "-mamx-int8"]
        built = subprocess.run([cc, *flags, str(PROBE), "-o", str(exe)], check=False)
        if built.returncode != 0:
            return {}
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


# calls of each shape in one Llama-3.2-1B forward: per layer q, o (2048x2048), k, v, gate, up, down; the lm_head
FORWARD_CALLS = {"q/o 2048x2048": 32, "k/v 512x2048": 32, "gate|up 8192x2048": 32, "down 2048x8192": 16,
                 "lm_head 128256x2048": 1}


def print_forward(rows: list[dict], variants: list[str], tokens: list[int]) -> None:
    """The matmul ms of one 1B forward per variant and T (sum of the shapes' median ms x their calls)."""
    print("\n| one 1B forward's matmuls, ms | " + " | ".join(variants) + " |")
    print("|---:|" + "---:|" * len(variants))
    for t in tokens:
        ms = {v: sum(r["ms"][v] * FORWARD_CALLS[r["shape"]] for r in rows if r["tokens"] == t) for v in variants}
        print(f"| T = {t} | " + " | ".join(f"{ms[v]:.0f}" for v in variants) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 512])
    p.add_argument("--variants", nargs="+", default=["avx512/16", "avx512/12", "avx512/8", "avx512_amx/16",
                                                     "avx512_amx/12", "avx512_amx/8"])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--wall", action="store_true", help="time wall-clock seconds (several kernel threads)")
    p.add_argument("--forward", action="store_true",
                   help="also k/v 512x2048 and the lm_head 128256x2048, and the matmul ms of one 1B forward "
                        "(16 layers of q, k, v, o, gate, up, down + lm_head) per variant and T")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 1 <= args.repeat <= 100 or not all(1 <= t <= 8192 for t in args.tokens):
        p.error("--repeat must be 1..100 and --tokens 1..8192")
    if ext.load() is None:
        sys.exit("the kernels are not built: python -m kernels.build")
    variants = [(v, v.split("/")[0], int(v.split("/")[1])) for v in args.variants]
    missing = {isa for _, isa, _ in variants} - set(ext.supported_isas())
    if missing:
        sys.exit(f"this CPU or build lacks {sorted(missing)} (has {ext.supported_isas()})")
    clock = time.perf_counter if args.wall else time.process_time
    rows = []
    print("| shape | T | " + " | ".join(v for v, _, _ in variants) + " |")
    print("|---|---:|" + "---:|" * len(variants))
    shapes = dict(SHAPES["1b"])
    if args.forward:
        shapes |= {"k/v 512x2048": (512, 2048), "lm_head 128256x2048": (128256, 2048)}
    for name, (n, k) in shapes.items():
        q, s, b = random_packed(n, k, seed=n + k, huge_pages=False)
        for tokens in args.tokens:
            x = mx.random.normal((tokens, k), key=mx.random.key(tokens))
            mx.eval(x)
            times: dict[str, list[float]] = {v: [] for v, _, _ in variants}
            for rep in range(args.repeat + 1):  # the first round warms up
                for label, isa, bits in variants:
                    ext.set_cpu_isa(isa)
                    start = clock()
                    mx.eval(ext.quantized_matmul(x, q, s, b, bits=4, group_size=32, columns=[n], activation_bits=bits))
                    if rep:
                        times[label].append(clock() - start)
            ext.set_cpu_isa("auto")
            gflops = {v: 2 * n * k * tokens / statistics.median(t) / 1e9 for v, t in times.items()}
            rows.append({"shape": name, "tokens": tokens, "gflops": gflops,
                         "ms": {v: 1e3 * statistics.median(t) for v, t in times.items()}})
            print(f"| {name} | {tokens} | " + " | ".join(f"{gflops[v]:.0f}" for v, _, _ in variants) + " |",
                  flush=True)
    if args.forward:
        print_forward(rows, [v for v, _, _ in variants], args.tokens)
    peak = amx_peak()
    if peak:
        print(f"AMX probe of one core (GOP/s; *_ns: ns per product): {peak}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "amx_peak": peak}))


if __name__ == "__main__":
    main()
