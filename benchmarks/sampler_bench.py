"""Cost of one sampling step: `Sampler.prepare` (host) + `Sampler.sample` (device, incl. .tolist()).

    .venv/bin/python benchmarks/sampler_bench.py                 # 32 rows, V = 49152 (the default model)
    .venv/bin/python benchmarks/sampler_bench.py --decode-step   # also time the model's decode step
    .venv/bin/python benchmarks/sampler_bench.py --rows 8 --repeat 50
    .venv/bin/python benchmarks/sampler_bench.py --vocab 128256 --backends kernel,reference   # A/B, alternated

Logits are synthetic but shaped like a language model's: Zipf-like over shuffled ids
(p ~ rank^-ALPHA, plus noise), so top_p nuclei hold tens of tokens; the "flat" scenarios use standard normal
logits (a random-weight model, or temperature >= 1 on a real one), whose top_p 0.9 nucleus holds most of
the vocabulary. --backends times each scenario with each backend's Sampler (kernels.sampling's kernels
or MLX's ops), alternating them run by run so both see the same machine load. Reports the median and the best
of --repeat runs per scenario and the median as a share of a decode step: --step-ms (250 ms, the
default model at batch 32 on this project's 2-core CPU), or, with --decode-step, the default model's
batch-S decode step (context 128) timed in the same process, so both see the same machine load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from metrale.sampling.sampler import Sampler  # noqa: E402
from metrale.sampling_params import SamplingParams  # noqa: E402

ALPHA = 1.6


@dataclass
class Row:
    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


def lm_like_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    out = np.empty((rows, vocab), dtype=np.float32)  # (S, V)
    for i in range(rows):
        values = -ALPHA * np.log(ranks) + rng.normal(0.0, 0.3, vocab)
        out[i] = values[rng.permutation(vocab)] + 12.0
    return out


def history(rng: np.random.Generator, vocab: int, prompt: int, output: int) -> tuple[list[int], list[int]]:
    return rng.integers(0, vocab, prompt).tolist(), rng.integers(0, vocab, output).tolist()


def scenarios(rng: np.random.Generator, rows: int, vocab: int) -> dict[str, tuple[str, list[Row]]]:
    """name -> (logits kind: "lm" | "flat", the rows)."""
    def mixed(i: int) -> Row:
        kind = i % 4
        prompt, output = history(rng, vocab, 200, 100)
        if kind == 0:
            params = SamplingParams(temperature=0.0, logprobs=5 if i % 16 == 0 else None)
        elif kind == 1:
            params = SamplingParams(temperature=0.8, seed=i if i % 8 == 1 else None)
        elif kind == 2:
            params = SamplingParams(temperature=1.0, top_k=40 + i, top_p=0.9)
        else:
            params = SamplingParams(temperature=0.7, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                                    presence_penalty=0.5 if i % 8 == 3 else 0.0, seed=i)
        return Row(params, prompt, output)

    def penalized(i: int) -> Row:
        prompt, output = history(rng, vocab, 1000, 200)
        return Row(SamplingParams(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3), prompt, output)

    def same(params: SamplingParams) -> list[Row]:
        return [Row(params) for _ in range(rows)]

    return {
        "greedy (fast path)": ("lm", same(SamplingParams(temperature=0.0))),
        "mixed (greedy/temp/top_k+top_p/top_p+min_p+penalties)": ("lm", [mixed(i) for i in range(rows)]),
        "temperature 1.0 (OpenAI default)": ("lm", [Row(SamplingParams(seed=i)) for i in range(rows)]),
        "top_k 40": ("lm", same(SamplingParams(top_k=40))),
        "top_k 50 + top_p 0.9": ("lm", same(SamplingParams(top_k=50, top_p=0.9))),
        "top_p 0.9 alone": ("lm", same(SamplingParams(top_p=0.9))),
        "top_p 0.9 alone, flat logits": ("flat", same(SamplingParams(top_p=0.9))),
        "top_p 0.95 + min_p 0.05, flat logits": ("flat", same(SamplingParams(top_p=0.95, min_p=0.05))),
        "penalties, 1000+200 token histories": ("lm", [penalized(i) for i in range(rows)]),
        "greedy + logprobs 5": ("lm", same(SamplingParams(temperature=0.0, logprobs=5))),
        "temperature 1.0 + logprobs 20": ("lm", same(SamplingParams(logprobs=20))),
    }


def time_scenario(samplers: list[Sampler], logits: mx.array, rows: list[Row],
                  repeat: int) -> list[tuple[list[float], float]]:
    """Per sampler: the totals of `repeat` runs and the median prepare time; the samplers alternate run by run."""
    for sampler in samplers:
        sampler.sample(logits, sampler.prepare(rows))  # warm-up
    totals: list[list[float]] = [[] for _ in samplers]
    prepares: list[list[float]] = [[] for _ in samplers]
    for _ in range(repeat):
        for j, sampler in enumerate(samplers):
            start = time.perf_counter()
            batch = sampler.prepare(rows)
            middle = time.perf_counter()
            sampler.sample(logits, batch)
            totals[j].append(time.perf_counter() - start)
            prepares[j].append(middle - start)
    return [(t, statistics.median(p)) for t, p in zip(totals, prepares)]


def nucleus_size(logits: np.ndarray, top_p: float) -> float:
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ordered = -np.sort(-probs, axis=1)
    return float(np.mean((np.cumsum(ordered, axis=1) - ordered < top_p).sum(axis=1)))


def decode_step_ms(rows: int, context: int = 128, repeat: int = 5) -> float:
    """Median time of one batch-`rows` decode step (forward + logits) of the default model."""
    from kvcache.attention import AttentionMetadata
    from metrale.config import EngineConfig
    from metrale.engine.runner import ModelRunner

    runner = ModelRunner.load(EngineConfig(kv_cache_bytes=256 << 20))
    block_size = runner.kv_cache.block_size
    per_seq = context // block_size + 1
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(rows)]
    metadata = AttentionMetadata.build([1] * rows, [context] * rows, tables, block_size)
    token_ids = mx.array([100 + s for s in range(rows)], dtype=mx.int32)  # (S,)

    def step() -> None:
        hidden = runner.model(token_ids, metadata.positions, runner.kv_cache, metadata)  # (S, D)
        mx.eval(runner.model.compute_logits(hidden))  # (S, V)

    step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--step-ms", type=float, default=250.0, help="decode step to compare against")
    parser.add_argument("--decode-step", action="store_true", help="time the default model's decode step")
    parser.add_argument("--backends", default="", help="comma-separated Sampler backends to alternate, e.g. "
                        "kernel,reference ('' : the default one)")
    args = parser.parse_args()
    if args.decode_step:
        args.step_ms = decode_step_ms(args.rows)
        print(f"default model decode step, batch {args.rows}, context 128: {args.step_ms:.1f} ms (median)")
    rng = np.random.default_rng(0)
    host_logits = lm_like_logits(rng, args.rows, args.vocab)
    logits = {"lm": mx.array(host_logits),
              "flat": mx.array(rng.standard_normal((args.rows, args.vocab)).astype(np.float32))}  # (S, V) each
    mx.eval(*logits.values())
    backends = args.backends.split(",")
    samplers = [Sampler(args.vocab, eos_token_ids=(2,), seed=0, backend=b or None) for b in backends]
    print(f"device {mx.default_device()}, S={args.rows}, V={args.vocab}, repeat={args.repeat}, "
          f"mean top_p=0.9 nucleus {nucleus_size(host_logits, 0.9):.0f} tokens "
          f"(flat: {nucleus_size(np.array(logits['flat']), 0.9):.0f})")
    print(f"{'scenario':56s} {'backend':>9s} {'median ms':>10s} {'best ms':>8s} {'prepare':>8s} {'% of step':>9s}")
    for name, (kind, rows) in scenarios(rng, args.rows, args.vocab).items():
        for backend, (totals, prepare) in zip(backends, time_scenario(samplers, logits[kind], rows, args.repeat)):
            median = statistics.median(totals) * 1e3
            print(f"{name:56s} {backend or 'default':>9s} {median:10.2f} {min(totals) * 1e3:8.2f} "
                  f"{prepare * 1e3:8.2f} {100 * median / args.step_ms:8.1f}%")

if __name__ == "__main__":
    main()
