"""Decode throughput of the engine on tiny random qwen3 and gemma3 models loaded from HF folders.

    .venv/bin/python benchmarks/tiny_arch_bench.py --archs qwen3 gemma3 llama --concurrency 1 8 32

Each architecture gets a random model folder written to a temp dir (config.json, model.safetensors,
a placeholder tokenizer.json): by default hidden 256, 4 layers, 4 heads of 64 (2 kv heads),
intermediate 1024, vocab 8192; gemma3 alternates sliding (window 64) and global layers. Every
stream gets a distinct random prompt of --prompt-len tokens, all submitted at once, ignore_eos.

Reported per level: output tok/s over the whole run (prefill included), and decode tok/s: the
tokens that arrive after the last stream's first token, over the time after it (all streams
decoding together).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.engine.startup import RunnerKeeper  # noqa: E402
from metrale.models import ModelConfig, get_model_class  # noqa: E402


def arch_config(arch: str, args: argparse.Namespace) -> dict:
    """A config.json mapping of the given size."""
    base = {
        "hidden_size": args.hidden, "num_hidden_layers": args.layers, "intermediate_size": 4 * args.hidden,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": max(1, args.hidden // 128),
        "head_dim": 64, "vocab_size": args.vocab, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True,
    }
    if arch == "gemma3":
        return {**base, "model_type": "gemma3_text", "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 64,
                "sliding_window": args.window, "sliding_window_pattern": 2}
    return {**base, "model_type": arch}


def write_random_folder(root: Path, arch: str, args: argparse.Namespace) -> Path:
    """A model folder of random weights (mlx's default init, built by metrale's own model class)."""
    folder = root / arch
    folder.mkdir(parents=True)
    config = arch_config(arch, args)
    mx.random.seed(0)
    model = get_model_class(config["model_type"])(ModelConfig.from_hf_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    vocab = {"<eos>": 0, **{f"t{i}": i for i in range(1, args.vocab)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<eos>")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


async def run_level(engine: AsyncEngine, concurrency: int, args: argparse.Namespace) -> dict:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(1, args.vocab) for _ in range(args.prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    arrivals: list[tuple[float, int]] = []  # (time, tokens) of every delta
    firsts: list[float] = []

    async def one(prompt: list[int]) -> None:
        first = True
        async for out in engine.generate(prompt, params):
            if out.token_ids:
                now = time.perf_counter()
                arrivals.append((now, len(out.token_ids)))
                if first:
                    firsts.append(now)
                    first = False

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    end = time.perf_counter()
    engine.check_integrity()
    total = sum(n for _, n in arrivals)
    decode_start = max(firsts)
    decoded = sum(n for t, n in arrivals if t > decode_start)
    return {
        "concurrency": concurrency, "output_tokens": total, "wall_s": round(end - start, 3),
        "output_tok_per_s": round(total / (end - start), 1),
        "decode_tok_per_s": round(decoded / (end - decode_start), 1) if end > decode_start else None,
    }


async def bench_arch(folder: Path, arch: str, args: argparse.Namespace) -> dict:
    config = EngineConfig(model=str(folder), max_num_seqs=max(args.concurrency), kv_cache_bytes=256 << 20,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    keeper = RunnerKeeper()
    async with AsyncEngine(config, runner_factory=keeper) as engine:
        load_s = keeper.runner.load_seconds
        await engine.complete([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        rows = []
        for c in args.concurrency:
            row = await run_level(engine, c, args)
            rows.append(row)
            print(f"{arch:7s} concurrency {c:3d}: decode {row['decode_tok_per_s']:8.1f} tok/s, overall "
                  f"{row['output_tok_per_s']:8.1f} tok/s ({row['output_tokens']} tokens in {row['wall_s']:.2f} s)",
                  flush=True)
    return {"arch": arch, "config": arch_config(arch, args), "load_s": round(load_s, 3), "levels": rows}


async def main(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return [await bench_arch(write_random_folder(Path(tmp), a, args), a, args) for a in args.archs]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--archs", nargs="+", default=["qwen3", "gemma3"],
                        choices=["qwen3", "gemma3", "llama", "qwen2"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--window", type=int, default=64, help="gemma3's sliding window")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results/tiny_arch_bench.json")
    args = parser.parse_args()
    results = asyncio.run(main(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.machine(), "python": platform.python_version(),
                               "results": results}, indent=2))
    print(f"wrote {out}")
