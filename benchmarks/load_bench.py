"""Load time and resident memory of a model (default: the default SmolLM2-135M Q4_1 GGUF), each
run in a fresh interpreter; and, with --quantized-matmul, MLX's CPU quantized matmul against the
float32 matmul that dequantizing at load time buys.

    .venv/bin/python benchmarks/load_bench.py                       # default model, 3 fresh processes
    .venv/bin/python benchmarks/load_bench.py --model path/to/folder --keep-quantized
    .venv/bin/python benchmarks/load_bench.py --quantized-matmul    # the CPU choice for quantized folders
    .venv/bin/python benchmarks/load_bench.py --export-folder /tmp/smollm2-q4 --bits 4   # then --model it

--export-folder writes the default model as a Hugging Face / MLX folder (bfloat16 safetensors, or
MLX-quantized with --bits), to measure the folder loader at a real model's size offline.

Per run: `import_s` (metrale + mlx imports), `load_s` (LoadedModel.load_seconds: read, dequantize,
build, evaluate), RSS before and after the load and its peak (VmHWM), and MLX's active / peak
allocations. Prints one line per run and the medians, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 1 << 20


def _rss_mib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return fields


def child(model: str | None, keep_quantized: bool | None) -> dict:
    """One load in this (fresh) process."""
    before = _rss_mib()["VmRSS"]
    start = time.perf_counter()
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import metrale.loading.folder  # noqa: F401  (the loaders' imports count as imports, not load)
    import metrale.loading.gguf  # noqa: F401
    from metrale.loading import load_model

    imported = time.perf_counter()
    after_import = _rss_mib()["VmRSS"]
    loaded = load_model(model, keep_quantized=keep_quantized)
    rss = _rss_mib()
    params = sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
    return {
        "model": str(loaded.path.name), "architecture": loaded.config.architecture, "dtype": str(loaded.dtype),
        "quantized_modules": len(loaded.quantization), "parameters": params,
        "import_s": round(imported - start, 3), "load_s": round(loaded.load_seconds, 3),
        "rss_start_mib": round(before, 1), "rss_after_import_mib": round(after_import, 1),
        "rss_after_load_mib": round(rss["VmRSS"], 1), "rss_peak_mib": round(rss["VmHWM"], 1),
        "mlx_active_mib": round(mx.get_active_memory() / MiB, 1), "mlx_peak_mib": round(mx.get_peak_memory() / MiB, 1),
    }


def run_loads(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child"]
    if args.model:
        cmd += ["--model", args.model]
    if args.keep_quantized is not None:
        cmd += ["--keep-quantized" if args.keep_quantized else "--dequantize"]
    rows = []
    for i in range(args.runs):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"run {i + 1}: load {row['load_s']:.2f} s (imports {row['import_s']:.2f} s), RSS "
              f"{row['rss_after_import_mib']:.0f} -> {row['rss_after_load_mib']:.0f} MiB "
              f"(peak {row['rss_peak_mib']:.0f}), MLX active {row['mlx_active_mib']:.0f} MiB (peak {row['mlx_peak_mib']:.0f})", flush=True)
    keys = ("import_s", "load_s", "rss_after_import_mib", "rss_after_load_mib", "rss_peak_mib",
            "mlx_active_mib", "mlx_peak_mib")
    median = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}
    print(f"median: load {median['load_s']:.2f} s, RSS after load {median['rss_after_load_mib']:.0f} MiB "
          f"(+{median['rss_after_load_mib'] - median['rss_after_import_mib']:.0f} over the imports), "
          f"peak {median['rss_peak_mib']:.0f} MiB")
    return {"runs": rows, "median": median}


def quantized_matmul_bench(repeats: int) -> list[dict]:
    """x (T, in) @ W.T for SmolLM2-135M's projection shapes: float32 (OpenBLAS) against MLX's
    quantized_matmul (4-bit, group 64, as mlx-lm writes folders) with bfloat16 and float32 scales."""
    import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)
    import mlx.core as mx

    def timed(fn) -> float:
        mx.eval(fn())  # warm up
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(fn())
        return (time.perf_counter() - start) / repeats * 1e3  # ms

    rows, q4 = [], {"group_size": 64, "bits": 4}
    for out_f, in_f in ((576, 576), (1536, 576), (576, 1536)):
        w = mx.random.normal((out_f, in_f))  # (out, in)
        packed, scales, biases = mx.quantize(w, group_size=64, bits=4)
        dense = mx.dequantize(packed, scales, biases, group_size=64, bits=4)  # (out, in) float32
        s16, b16 = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
        mx.eval(dense, s16, b16)
        for tokens in (1, 8, 32, 128):
            x = mx.random.normal((tokens, in_f))  # (T, in)
            x16 = x.astype(mx.bfloat16)
            mx.eval(x, x16)
            row = {
                "shape": f"{in_f}->{out_f}", "tokens": tokens,
                "float32_ms": timed(lambda: x @ dense.T),
                "q4_f32_scales_ms": timed(lambda: mx.quantized_matmul(x, packed, scales, biases, **q4)),
                "q4_bf16_ms": timed(lambda: mx.quantized_matmul(x16, packed, s16, b16, **q4)),
            }
            row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            rows.append(row)
            print(f"{row['shape']:>9} T={tokens:3d}: float32 {row['float32_ms']:.3f} ms, quantized (f32 scales) "
                  f"{row['q4_f32_scales_ms']:.3f} ms ({row['q4_f32_scales_ms'] / row['float32_ms']:.1f}x), "
                  f"quantized bf16 {row['q4_bf16_ms']:.3f} ms ({row['q4_bf16_ms'] / row['float32_ms']:.1f}x)",
                  flush=True)
    return rows


def export_default_as_folder(dest: Path, bits: int | None) -> None:
    """The default GGUF model as a folder: config.json, model.safetensors (bfloat16, or MLX affine
    `bits`-bit, group 64, as mlx_lm.convert writes it), tokenizer.json, tokenizer_config.json."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from metrale.loading import load_model

    loaded = load_model(None, keep_quantized=False)
    c, model = loaded.config, loaded.model
    config = {
        "model_type": c.architecture, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "bfloat16",
    }
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits, "mode": "affine"}
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())), {"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tok = loaded.tokenizer
    tok.backend.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tok.bos_token, "eos_token": tok.eos_tokens[0] if tok.eos_tokens else None,
        "chat_template": tok.chat_template,
    }))
    print(f"wrote {dest} ({'bfloat16' if not bits else f'{bits}-bit'})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file, model folder or hub id (default: the default model)")
    quant = parser.add_mutually_exclusive_group()
    quant.add_argument("--keep-quantized", dest="keep_quantized", action="store_true", default=None)
    quant.add_argument("--dequantize", dest="keep_quantized", action="store_false")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quantized-matmul", action="store_true", help="run the matmul comparison instead")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--export-folder", type=Path, default=None, help="write the default model as a folder")
    parser.add_argument("--bits", type=int, default=None, help="with --export-folder: MLX-quantize to this many bits")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/load_bench*.json)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.keep_quantized)))
        sys.exit(0)
    if args.export_folder:
        export_default_as_folder(args.export_folder, args.bits)
        sys.exit(0)
    result = {"machine": platform.machine(), "python": platform.python_version()}
    if args.quantized_matmul:
        result["quantized_matmul"] = quantized_matmul_bench(args.repeats)
    else:
        result.update(run_loads(args), model=args.model or "default", keep_quantized=args.keep_quantized)
    default = "load_bench_quantized_matmul.json" if args.quantized_matmul else "load_bench.json"
    out = Path(args.out or f"benchmarks/results/{default}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
