"""Prompt processing and decode on the real default model at long contexts, before/after in one run.

    .venv/bin/python benchmarks/long_prompt_bench.py --before /work/main --rounds 2
    .venv/bin/python benchmarks/long_prompt_bench.py --model /tmp/metrale-shapes/llama-1b-q4_0.gguf \
        --variants "after f16" --rounds 1 --decode-steps 2

Each variant is a fresh process (`--worker`) that loads the model (`--model`, a GGUF; default: the default
model, SmolLM2-135M Q4_1), prefills
a random prompt of N tokens in chunks of `--chunk` (as the scheduler's max_num_batched_tokens) through
the model's forward over a paged cache, then decodes `--decode-steps` tokens one at a time; it prints the
prompt tok/s and the mean decode step per N, and each length's prompt rate as a ratio of the first's
(the target: >= 0.9 up to 8k). Variants: "before f32" / "before f16" (the tree at --before
with a float32 / float16 cache), "after f32" and "after f16" (this tree). They run alternately, round after
round, and the median per variant is reported: the machine is shared, so load hits every variant alike.
The model forward only: no scheduler, sampling or HTTP (their cost does not grow with the context).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(model_path: str | None, lengths: list[int], chunk: int, decode_steps: int, kv_dtype: str) -> None:
    import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)
    import mlx.core as mx
    import numpy as np

    from kernels.backend import select_backends
    from kvcache.storage import PagedKVCache
    from metrale.engine.step import ForwardInput
    from metrale.loading import load_model

    loaded = load_model(model_path, dtype=None)
    mc, model = loaded.config, loaded.model
    backend = select_backends().attention
    block = 16
    longest = max(lengths) + decode_steps
    cache = PagedKVCache(mc.num_hidden_layers, -(-longest // block), block, mc.num_key_value_heads, mc.head_dim,
                         getattr(mx, kv_dtype))
    table = tuple(range(cache.num_blocks))
    rng = np.random.default_rng(0)

    def forward(tokens, ctx):
        hidden = ForwardInput(tuple(tokens), (len(tokens),), (ctx,), (table,), block).run(model, cache, backend)
        logits = model.compute_logits(hidden[-1:])
        mx.eval(logits, [cache.layer(i) for i in range(cache.num_layers)])
        return int(mx.argmax(logits[0]).item())

    forward([1] * 32, 32)  # warm-up
    result = {}
    for n in lengths:
        prompt = rng.integers(100, mc.vocab_size - 100, size=n).tolist()
        start = time.perf_counter()
        for done in range(0, n, chunk):
            token = forward(prompt[done : done + chunk], min(n, done + chunk))
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for step in range(decode_steps):
            token = forward([token], n + step + 1)
        decode_s = (time.perf_counter() - start) / decode_steps
        result[n] = {"prompt_tok_s": n / prefill_s, "decode_ms": decode_s * 1e3}
    print("RESULT " + json.dumps(result), flush=True)


def run_variant(tree: Path, kv_dtype: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    model = ["--model", str(Path(args.model).resolve())] if args.model else []
    cmd = [sys.executable, str(HERE), "--worker", *model, "--kv-dtype", kv_dtype, "--chunk", str(args.chunk),
           "--decode-steps", str(args.decode_steps), "--lengths", *map(str, args.lengths)]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line.removeprefix("RESULT ")).items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, help="a checkout of the code before (float32 cache); omitted: after only")
    p.add_argument("--model", help="a GGUF file (default: the default model)")
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=["before f32", "after f16", "after f32"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kv-dtype", default="float16", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.model, args.lengths, args.chunk, args.decode_steps, args.kv_dtype)
        return
    variants = {"after f16": (HERE.parents[1], "float16"), "after f32": (HERE.parents[1], "float32")}
    if args.before is not None:
        variants = {"before f32": (args.before.resolve(), "float32"), "before f16": (args.before.resolve(), "float16"),
                    **variants}
    variants = {name: v for name, v in variants.items() if name in args.variants}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name, (tree, kv_dtype) in variants.items():
            runs[name].append(run_variant(tree, kv_dtype, args))
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    print(f"median of {args.rounds} alternating rounds; prompt in chunks of {args.chunk}; "
          f"decode: mean of {args.decode_steps} steps after the prompt")
    print(f"{'variant':12s} " + " ".join(f"{f'pp{n} tok/s':>12s} {f'dec@{n} ms':>11s}" for n in args.lengths))
    for name, rs in runs.items():
        cells = []
        for n in args.lengths:
            cells.append(f"{statistics.median(x[n]['prompt_tok_s'] for x in rs):12.0f} "
                         f"{statistics.median(x[n]['decode_ms'] for x in rs):11.1f}")
        print(f"{name:12s} " + " ".join(cells))
    first = args.lengths[0]
    for name, rs in runs.items():
        base = statistics.median(x[first]["prompt_tok_s"] for x in rs)
        rates = {n: statistics.median(x[n]["prompt_tok_s"] for x in rs) for n in args.lengths}
        ratios = " ".join(f"{n}: {rate / base:.2f}" for n, rate in rates.items())
        print(f"{name:12s} prompt rate / rate at {first}: {ratios}")


if __name__ == "__main__":
    main()
