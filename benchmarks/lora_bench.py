"""Output throughput of a batch mixing LoRA adapters against the same batch without one, on the default model.

    .venv/bin/python benchmarks/lora_bench.py                      # 8 streams x 64 tokens, 3 rounds
    .venv/bin/python benchmarks/lora_bench.py --streams 8 --max-tokens 128 --rounds 5 --json out.json

Four random adapters (mlx-lm layout, every q/k/v/o/gate/up/down projection of every layer; ranks 8, 8, 16
and 16) are written to a temporary folder and registered; the "mixed" batch gives stream i adapter i % 4,
the "base" batch none. Both batches have the same prompts (32 distinct tokens each, so the prefix cache
shares nothing), greedy, ignore_eos. A warm-up batch of each kind first (adapter loading, allocator caches),
then the rounds alternate base / mixed; each figure is generated tokens / wall seconds of one whole batch
(prefill included), and the median over the rounds is reported with the spread. The machine's load
average is printed with the figures: the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.models.lora_spec import lora_targets  # noqa: E402

RANKS = (8, 8, 16, 16)


def write_adapter(folder: Path, targets: dict[str, tuple[int, int]], num_layers: int, rank: int, seed: int) -> str:
    """A random mlx-lm adapter over every target of every layer (B non-zero, scale 1)."""
    folder.mkdir(parents=True)
    mx.random.seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for key, (fan_in, fan_out) in targets.items():
            tensors[f"model.layers.{layer}.{key}.lora_a"] = mx.random.normal((fan_in, rank)) / fan_in ** 0.5
            tensors[f"model.layers.{layer}.{key}.lora_b"] = 0.1 * mx.random.normal((rank, fan_out)) / rank ** 0.5
    mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
    config = {"fine_tune_type": "lora", "num_layers": num_layers,
              "lora_parameters": {"rank": rank, "scale": 1.0, "dropout": 0.0, "keys": sorted(targets)}}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


async def batch(engine: AsyncEngine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    """Output tokens per second of one batch run to its end."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.complete(p, params, lora=a) for p, a in zip(prompts, adapters)))
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


async def run(args: argparse.Namespace) -> dict:
    config = EngineConfig(model=args.model, max_num_seqs=max(args.streams, 8), max_loras=len(RANKS))
    async with AsyncEngine(config) as engine:
        from metrale.loading import load_model  # the model config, for the adapters' shapes
        model_config = load_model(args.model).config
        targets = lora_targets(model_config)
        with tempfile.TemporaryDirectory() as root:
            for i, rank in enumerate(RANKS):
                await engine.add_lora(f"r{rank}-{i}", write_adapter(Path(root) / str(i), targets,
                                                                     model_config.num_hidden_layers, rank, i))
            names = list(engine.list_loras())
            vocab = model_config.vocab_size
            prompts = [[(1000 + 97 * s + 13 * t) % vocab for t in range(32)] for s in range(args.streams)]
            mixed = [names[s % len(names)] for s in range(args.streams)]
            base = [None] * args.streams
            await batch(engine, prompts, base, 8)
            await batch(engine, prompts, mixed, 8)
            figures: dict[str, list[float]] = {"base": [], "mixed": []}
            for _ in range(args.rounds):
                figures["base"].append(await batch(engine, prompts, base, args.max_tokens))
                figures["mixed"].append(await batch(engine, prompts, mixed, args.max_tokens))
    return {"streams": args.streams, "max_tokens": args.max_tokens, "ranks": RANKS, "rounds": figures,
            "median_tok_s": {k: statistics.median(v) for k, v in figures.items()},
            "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or model folder (default: SmolLM2-135M Q4_1)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    result = asyncio.run(run(args))
    medians = result["median_tok_s"]
    print(f"{args.streams} streams x {args.max_tokens} tokens, {args.rounds} rounds (output tok/s, whole batch)")
    for kind in ("base", "mixed"):
        rounds = ", ".join(f"{x:.1f}" for x in result["rounds"][kind])
        print(f"  {kind:5s}  median {medians[kind]:7.1f}   rounds [{rounds}]")
    print(f"  mixed / base = {medians['mixed'] / medians['base']:.3f}; load average after: {result['load_average']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
