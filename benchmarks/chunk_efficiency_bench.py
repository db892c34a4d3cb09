"""What a prompt chunk of n tokens costs beside running decodes, at a long context: the chunk-size knee.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/chunk_efficiency_bench.py --contexts 4096 8000 \
        --chunks 1 2 4 8 16 32 64 128 256 512 --repeat 3 [--model /tmp/metrale-shapes/llama-1b-q4_0.gguf]

The model forward only (no scheduler, sampling or HTTP), over a paged cache (float16 unless --kv-dtype): a
random prompt is prefilled to each context in chunks of 512; then, per chunk size n, the median of --repeat
forwards of one step holding --decodes decodes (at context --decode-context) and the prompt's next n tokens,
minus the same decodes alone run just before (median over --repeat rounds of every size, so the machine's
load hits every size alike). Printed per context and n: the step, the chunk's marginal ms,
its ms per prompt token and that per-token cost over the 512-token chunk's ("rel"): 1.0 = as efficient as a
full chunk. The scheduler's time budget (scheduler/step_budget.py) sizes chunks; chunks far below the knee
(where rel climbs) cost the long prompt's TTFT more than they save the streams' step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(model_path: str | None, contexts: list[int], chunks: list[int], decodes: int, decode_context: int,
            repeat: int, kv_dtype: str) -> dict:
    import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)
    import mlx.core as mx
    import numpy as np

    from kernels.backend import select_backends
    from kvcache.storage import PagedKVCache
    from metrale.engine.step import ForwardInput
    from metrale.loading import load_model

    mc, model = (loaded := load_model(model_path, dtype=None)).config, loaded.model
    backend = select_backends().attention
    block = 16
    long_blocks = -(-(max(contexts) + max(chunks)) // block)
    decode_blocks = -(-(decode_context + 1) // block)
    cache = PagedKVCache(mc.num_hidden_layers, long_blocks + decodes * decode_blocks, block,
                         mc.num_key_value_heads, mc.head_dim, getattr(mx, kv_dtype))
    long_table = tuple(range(long_blocks))
    decode_tables = tuple(tuple(range(long_blocks + i * decode_blocks, long_blocks + (i + 1) * decode_blocks))
                          for i in range(decodes))
    rng = np.random.default_rng(0)

    def step(chunk: list[int], context: int) -> float:
        """Seconds of one forward: the decodes, then `chunk` ending at `context` (none when empty)."""
        seqs = [([7], decode_context + 1, t) for t in decode_tables] + ([(chunk, context, long_table)] if chunk else [])
        tokens = tuple(t for s in seqs for t in s[0])
        start = time.perf_counter()
        hidden = ForwardInput(tokens, tuple(len(s[0]) for s in seqs), tuple(s[1] for s in seqs),
                              tuple(s[2] for s in seqs), block).run(model, cache, backend)
        mx.eval(model.compute_logits(hidden[-len(seqs):]), [cache.layer(i) for i in range(cache.num_layers)])
        return time.perf_counter() - start

    prompt = rng.integers(100, mc.vocab_size - 100, size=max(contexts) + max(chunks)).tolist()
    step([], 0)  # warm-up
    done, result = 0, {}
    for context in sorted(contexts):
        while done < context:  # prefill up to the context (its KV is what the chunks attend to)
            n = min(512, context - done)
            step(prompt[done:done + n], done + n)
            done += n
        decode_s: list[float] = []
        marginal: dict[int, list[float]] = {n: [] for n in chunks}
        steps: dict[int, list[float]] = {n: [] for n in chunks}
        for _ in range(repeat):  # rounds over every size, each beside its own decode-only step: load hits all alike
            for n in chunks:  # each chunk rewrites positions context..context+n-1: same work every repeat
                alone = step([], 0)
                steps[n].append(step(prompt[context:context + n], context + n))
                decode_s.append(alone)
                marginal[n].append(steps[n][-1] - alone)
        rows = {}
        for n in chunks:
            chunk_s = statistics.median(marginal[n])
            rows[n] = {"step_ms": 1e3 * statistics.median(steps[n]), "chunk_ms": 1e3 * chunk_s,
                       "ms_per_token": 1e3 * chunk_s / n}
        result[context] = {"decode_ms": 1e3 * statistics.median(decode_s), "chunks": rows}
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF path (default: the engine's default model)")
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8000])
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-context", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-dtype", default="float16")
    p.add_argument("--out", help="write the numbers as JSON here")
    args = p.parse_args(argv)
    result = measure(args.model, args.contexts, args.chunks, args.decodes, args.decode_context, args.repeat,
                     args.kv_dtype)
    for context, r in result.items():
        full = r["chunks"][max(r["chunks"])]["ms_per_token"]
        print(f"context {context}: {args.decodes} decodes alone {r['decode_ms']:.1f} ms")
        print(f"{'chunk':>6s} {'step ms':>9s} {'chunk ms':>9s} {'ms/token':>9s} {'rel':>6s}")
        for n, row in r["chunks"].items():
            print(f"{n:6d} {row['step_ms']:9.1f} {row['chunk_ms']:9.1f} {row['ms_per_token']:9.2f} "
                  f"{row['ms_per_token'] / full:6.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
