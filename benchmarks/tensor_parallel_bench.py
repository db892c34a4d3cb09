"""Decode throughput with tensor parallelism: the same random model at TP=1 and TP=2 (or more).

    .venv/bin/python benchmarks/tensor_parallel_bench.py --sizes 1 2 --concurrency 1 8
    .venv/bin/python benchmarks/tensor_parallel_bench.py --bits 0       # float32 weights (BLAS) instead of 4-bit

The model is SmolLM2-135M's shape with heads that 2 divides: hidden 576, 30 layers, 8 heads of 72
(2 kv heads), intermediate 1536, vocab 49152, random weights, 4-bit group 32 by default (the CPU
kernels; --bits 0 keeps float32). SmolLM2-135M itself has 9 heads / 3 kv heads, which only TP=3
splits. Each size runs in its own process (MLX keeps one ring group per process); every stream gets
a distinct random prompt of --prompt-len tokens, all submitted at once, ignore_eos, greedy.

Reported per level: decode tok/s (the tokens that arrive after the last stream's first token, over
the time after it) and output tok/s over the whole run. The ranks of one machine share its cores:
TP=2 on 2 cores is not expected to be faster (each step adds two all_sums per layer, ~0.1 ms each
here, and the ranks' spinning collectives compete with the compute for the same two cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401,E402  (the OpenBLAS preload, before mlx)

from kernels.runtime import mx, nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.models import ModelConfig, get_model_class  # noqa: E402

CONFIG = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
          "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 49152, "rms_norm_eps": 1e-5,
          "rope_theta": 100000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True}


def write_model(folder: Path, bits: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = get_model_class("llama")(ModelConfig.from_hf_dict(CONFIG))
    config = dict(CONFIG)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, CONFIG["vocab_size"])}}
    Tokenizer(models.WordLevel(vocab, unk_token="<eos>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


async def level(engine: AsyncEngine, concurrency: int, args: argparse.Namespace) -> dict:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(1, CONFIG["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    arrivals: list[tuple[float, int]] = []
    firsts: list[float] = []

    async def one(prompt: list[int]) -> None:
        first = True
        async for out in engine.generate(prompt, params):
            if out.token_ids:
                arrivals.append((time.perf_counter(), len(out.token_ids)))
                if first:
                    firsts.append(arrivals[-1][0])
                    first = False

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    end = time.perf_counter()
    engine.check_integrity()
    decoded = sum(n for t, n in arrivals if t > max(firsts))
    return {"concurrency": concurrency, "decode_tok_per_s": round(decoded / (end - max(firsts)), 1),
            "output_tok_per_s": round(sum(n for _, n in arrivals) / (end - start), 1)}


async def run_size(folder: str, size: int, args: argparse.Namespace) -> dict:
    config = EngineConfig(model=folder, tensor_parallel_size=size, kv_cache_bytes=128 << 20,
                          max_num_seqs=max(args.concurrency))
    async with AsyncEngine(config) as engine:
        await engine.complete([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        return {"tensor_parallel_size": size, "levels": [await level(engine, c, args) for c in args.concurrency]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--bits", type=int, default=4, choices=[0, 4, 8])
    parser.add_argument("--run", nargs=2, metavar=("FOLDER", "SIZE"), help=argparse.SUPPRESS)  # one size, this process
    args = parser.parse_args()
    if args.run:
        print(json.dumps(asyncio.run(run_size(args.run[0], int(args.run[1]), args))), flush=True)
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(Path(tmp) / "model", args.bits)
        for size in args.sizes:
            argv = [sys.executable, __file__, "--run", str(folder), str(size), "--concurrency",
                    *map(str, args.concurrency), "--prompt-len", str(args.prompt_len), "--output-len",
                    str(args.output_len), "--bits", str(args.bits)]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise SystemExit(f"TP={size} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for row in result["levels"]:
                print(f"TP={size} concurrency {row['concurrency']:3d}: decode {row['decode_tok_per_s']:7.1f} tok/s, "
                      f"overall {row['output_tok_per_s']:7.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
