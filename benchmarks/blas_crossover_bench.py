"""Where (if anywhere) float32 BLAS on weights dequantized per call beats the quantized kernels: the
measurement behind kernels/qmm.py BLAS_CROSSOVER.

    .venv/bin/python benchmarks/blas_crossover_bench.py                       # 1B and 135M shapes
    .venv/bin/python benchmarks/blas_crossover_bench.py --shapes 1b --tokens 16 512 --repeat 7

For each matrix (random 4-bit group-32 weights, packed as the loader packs them) and T token rows, the
median wall time of one evaluated call (after one warm-up), in ms, of:
  k12, k8   ext.quantized_matmul with int12 (the default) or int8 activations, the running kernel set
  blas      kernels.qmm.dequantized_matmul: unpack the packed weight to float32, then x @ W.T (OpenBLAS)
and blas / k12, the factor a crossover at T would cost (> 1: the kernels are faster).
"""

from __future__ import annotations

import argparse

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from qmm_bench import timed

from kernels import ext
from kernels.qmm import QuantizedLinearCPU, dequantized_matmul

SHAPES = {  # (N, K) of each distinct matrix
    "1b": [(2048, 2048), (8192, 2048), (2048, 8192)],
    "135m": [(576, 576), (1536, 576), (576, 1536)],
}


def median_ms(fn, repeat: int) -> float:
    """The median wall ms of evaluating fn()'s outputs, after one warm-up call (qmm_bench.timed)."""
    return timed(lambda: mx.eval(fn()), repeat)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["1b", "135m"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16, 32, 128, 512])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if ext.load() is None:
        raise SystemExit("the CPU kernels are not built: .venv/bin/python -m kernels.build")
    print(f"kernel set {ext.cpu_isa()}; ms per call (median of {args.repeat})")
    print(f"{'N x K':>12} {'T':>5} {'k12':>9} {'k8':>9} {'blas':>9} {'blas/k12':>9}")
    for shape in args.shapes:
        for n, k in SHAPES[shape]:
            layer = QuantizedLinearCPU.from_layers([nn.QuantizedLinear(k, n, bias=False, group_size=32, bits=4)])
            mx.eval(layer.parameters())
            for tokens in args.tokens:
                x = mx.random.normal((tokens, k))
                mx.eval(x)

                def kernel(bits: int):
                    return lambda: ext.quantized_matmul(x, layer.q, layer.scales, layer.biases, bits=4,
                                                        group_size=32, columns=[n], activation_bits=bits)

                k12, k8 = median_ms(kernel(12), args.repeat), median_ms(kernel(8), args.repeat)
                blas = median_ms(lambda: dequantized_matmul(x, layer.q, layer.scales, layer.biases, bits=4,
                                                            columns=[n]), args.repeat)
                print(f"{f'{n}x{k}':>12} {tokens:>5} {k12:>9.2f} {k8:>9.2f} {blas:>9.2f} {blas / k12:>8.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
