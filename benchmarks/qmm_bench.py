"""All weight matmuls of one forward of the default model: the quantized CPU kernels vs float32 BLAS.

    .venv/bin/python benchmarks/qmm_bench.py                          # T = 1 8 32 128, the best kernel set
    .venv/bin/python benchmarks/qmm_bench.py --tokens 1 16 512 --isa scalar avx2 avx512 --repeat 7

For T token rows, each figure is the wall time of one evaluation of every matmul of a forward (30
layers x (q, k, v, o, gate, up, down) + the lm_head), in ms: the median over --repeat trials and,
in parentheses, the fastest. Rows:
  float32      dequantized weights, x @ W.T through MLX (OpenBLAS sgemm), one matmul per weight
  mlx-quant    MLX's own CPU quantized_matmul on the checkpoint's triples (--mlx-quantized; slow)
  <isa>/int16  the kernels (kernels/qmm.py) as the model runs them: q/k/v fused into one call,
               gate/up fused with the SwiGLU epilogue, the tied lm_head from the 8-bit embedding;
               int16, int12 or int8 activations (--activations)
Also the weight bytes each path reads and the ratio float32 / qmm. Compare ratios from one run; on a
busy machine `--clock cpu` with METRALE_ATTENTION_THREADS=1 OPENBLAS_NUM_THREADS=1 compares the work of one
core (OpenBLAS and the kernels each on one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import ext  # noqa: E402
from kernels.qmm import QuantizedEmbeddingCPU, QuantizedLinearCPU  # noqa: E402
from kernels.runtime import mx  # noqa: E402
from metrale.loading import load_model  # noqa: E402
from metrale.loading.weights import dequantize_affine  # noqa: E402


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, repeat: int, clock=time.perf_counter) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e3, min(times) * 1e3


def model_layers(model):
    """[(attn, mlp)] of every layer and the embedding, from a model loaded with quantized weights."""
    return [(layer.self_attn, layer.mlp) for layer in model.model.layers], model.model.embed_tokens


def float32_weights(model) -> list[mx.array]:
    layers, embed = model_layers(model)
    out = []
    for attn, mlp in layers:
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            out.append(dequantize_affine(lin.weight, lin.scales, lin.biases, lin.bits, lin.group_size))
    out.append(dequantize_affine(embed.weight, embed.scales, embed.biases, embed.bits, embed.group_size))
    mx.eval(out)
    return out


def kernel_calls(model) -> tuple[list[QuantizedLinearCPU], QuantizedEmbeddingCPU]:
    """The kernel modules of one forward, as metrale.models.cpu_quantized builds them."""
    layers, embed = model_layers(model)
    calls = []
    for attn, mlp in layers:
        calls.append(QuantizedLinearCPU.from_layers([attn.q_proj, attn.k_proj, attn.v_proj]))
        calls.append(QuantizedLinearCPU.from_layers([attn.o_proj]))
        calls.append(QuantizedLinearCPU.from_layers([mlp.gate_proj, mlp.up_proj], glu="silu"))
        calls.append(QuantizedLinearCPU.from_layers([mlp.down_proj]))
    embedding = QuantizedEmbeddingCPU(embed)
    for module in (*calls, embedding):
        module.blas_rows = None  # time the kernels at every size, whatever kernel set is chosen later
    return calls, embedding


def nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--isa", nargs="+", default=None, help="kernel sets to time (default: the best one)")
    parser.add_argument("--activations", type=int, nargs="+", default=[16, 8], choices=(8, 12, 16),
                        help="activation precisions to time (int16: the default; int12; int8: llama.cpp's Q8)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--mlx-quantized", action="store_true", help="also time MLX's CPU quantized_matmul")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                        help="cpu: the process's CPU time (all threads), steadier than wall time on a busy "
                             "machine; with METRALE_ATTENTION_THREADS=1 it is the work of one core")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if ext.load() is None or not ext.has_qmm_kernels():
        sys.exit("the CPU kernels are not built: python -m kernels.build")
    os.environ["METRALE_MATMUL"] = "reference"  # nn.QuantizedLinear modules, repacked here
    loaded = load_model(None, keep_quantized=True, dtype=mx.float32)
    model = loaded.model
    weights = float32_weights(model)
    calls, embed = kernel_calls(model)
    qbytes = sum(nbytes([m.q, m.scales, m.biases]) for m in calls) + nbytes([embed.q, embed.scales, embed.biases])
    print(f"weights read per forward: float32 {nbytes(weights) / 2**20:.0f} MiB, qmm {qbytes / 2**20:.1f} MiB")
    isas = args.isa or [ext.cpu_isa()]
    variants = [(isa, bits) for isa in isas for bits in args.activations]
    rows = []
    clock = CLOCK[args.clock]
    for t in args.tokens:
        xs = {k: mx.random.normal((t, k)) for k in {w.shape[1] for w in weights}}
        mx.eval(list(xs.values()))
        row = {"tokens": t}
        row["float32_ms"] = timed(lambda: mx.eval([xs[w.shape[1]] @ w.T for w in weights]), args.repeat, clock)

        def run_qmm():
            outs = [lin(xs[lin.in_features]) for lin in calls]
            outs.append(embed.as_linear(xs[embed.dims]))
            mx.eval(outs)
        for isa, bits in variants:
            ext.set_cpu_isa(isa)
            for module in (*calls, embed):
                module.activation_bits = bits
            row[f"qmm_{isa}_int{bits}_ms"] = timed(run_qmm, args.repeat, clock)
        ext.set_cpu_isa("auto")
        if args.mlx_quantized:
            qmods = [m for attn, mlp in model_layers(model)[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj,
                                                                          attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                                                          mlp.down_proj)]
            row["mlx_quantized_ms"] = timed(lambda: mx.eval([m(xs[m.scales.shape[1] * m.group_size]) for m in qmods]
                                                            + [model.model.embed_tokens.as_linear(xs[embed.dims])]),
                                            max(1, args.repeat // 3), clock)
        rows.append(row)
        parts = [f"T={t:4d}  float32 {row['float32_ms'][0]:8.2f} ({row['float32_ms'][1]:7.2f}) ms"]
        for isa, bits in variants:
            med, best = row[f"qmm_{isa}_int{bits}_ms"]
            parts.append(f"{isa}/int{bits} {med:7.2f} ({best:7.2f}) ms x{row['float32_ms'][0] / med:5.2f}")
        if "mlx_quantized_ms" in row:
            parts.append(f"mlx-quant {row['mlx_quantized_ms'][0]:8.1f} ms")
        print("  ".join(parts), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": platform.platform(), "args": vars(args), "rows": rows},
                                             indent=2))


if __name__ == "__main__":
    main()
