"""Per-step cost of structured outputs: 1, 8 and 32 constrained rows against the same rows unconstrained.

    .venv/bin/python benchmarks/structured_bench.py              # micro: rows 1 8 32, 48 steps each
    .venv/bin/python benchmarks/structured_bench.py --engine     # also the real engine's decode step

Micro (V = 49152 with the default model's tokenizer): a generation loop over random logits tilted
towards closing characters, through a mix of JSON schemas (nested objects, enums, arrays), sampled at
temperature 1; a row whose grammar finishes starts again, so every step has all its rows constrained.
Per step:
    fill     TokenConstraints.prepare: the constrained rows' bitmasks filled on the host (llguidance)
    apply    the device apply alone: ops.apply_bitmask over the batch's (S, V) logits, evaluated
    sample+  Sampler.prepare + sample with the masks minus the same without them (the bitmask's copy to
             the device, the apply, in the real sampler)
    accept   TokenConstraints.accept: every matcher takes its sampled token
The engine (--engine): B concurrent chat requests on the default model, each held in a long JSON array
of short strings by its schema (the worst case for the fill: a new mask state every token), against
the same requests unconstrained, in alternating rounds; the median decode step (ModelRunner.execute
with one token per request), in which the runner fills the masks while the forward is evaluated
(mx.async_eval), and that fill alone.
Medians over the steps; the machine is shared, so compare columns of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.runtime  # noqa: F401,E402  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from metrale.sampling.constraints import TokenConstraints  # noqa: E402
from metrale.sampling.guided import GrammarCompiler  # noqa: E402
from metrale.sampling.ops import apply_bitmask  # noqa: E402
from metrale.sampling.sampler import Sampler  # noqa: E402
from metrale.sampling_params import SamplingParams  # noqa: E402
from metrale.engine.startup import RunnerKeeper  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                                      "address": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24},
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                          "required": ["city", "zip"]}},
     "required": ["name", "age", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "in_stock": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 6}}, "required": ["color", "in_stock", "tags"]},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
                                "required": ["x", "ok"]}, "minItems": 1, "maxItems": 8},
]
LONG = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}  # never ends in a run


class Row:
    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.prompt_token_ids = [1]
        self.output_token_ids: list[int] = []


def ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def micro(rows: int, steps: int, compiler: GrammarCompiler, tokenizer, seed: int, temperature: float,
          extra_free: int) -> dict[str, float]:
    vocab = compiler.n_vocab
    rng = np.random.default_rng(seed)
    tilt = np.zeros(vocab, dtype=np.float32)
    for text in ('"', "}", "]", ",", "1", "true"):
        tilt[tokenizer.encode(text, add_special_tokens=False)[0]] = 5.0
    constraints = TokenConstraints(vocab, compiler)
    constrained = [Row(f"r{i}", SamplingParams(temperature=temperature, seed=i,
                                               structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)]}))
                   for i in range(rows)]
    constrained += [Row(f"x{i}", SamplingParams(temperature=temperature, seed=i)) for i in range(extra_free)]
    free = [Row(f"f{i}", msgspec.structs.replace(r.params, structured_outputs=None)) for i, r in enumerate(constrained)]
    total = rows + extra_free
    sampler = Sampler(vocab, eos_token_ids=tokenizer.eos_token_ids, seed=seed)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "sample_masked": [], "sample_free": [], "accept": []}
    restarts = 0
    for step in range(steps + 4):  # the first 4 steps warm up (mx.compile per shape, first masks)
        x = mx.array((rng.standard_normal((total, vocab)) * 2 + tilt).astype(np.float32))
        mx.eval(x)
        t0 = time.perf_counter()
        masks = constraints.prepare(constrained)
        t1 = time.perf_counter()
        mx.eval(apply_bitmask(x, mx.array(masks.bitmask)))
        t2 = time.perf_counter()
        order = [(True, constrained), (False, free)] if step % 2 else [(False, free), (True, constrained)]
        spans = {}
        for masked, batch_rows in order:
            s0 = time.perf_counter()
            if masked:
                out = sampler.sample(x, sampler.prepare(batch_rows, masks.bitmask))
            else:
                sampler.sample(x, sampler.prepare(batch_rows))
            spans[masked] = time.perf_counter() - s0
        t3 = time.perf_counter()
        outcome = constraints.accept(constrained, out.token_ids, masks)
        t4 = time.perf_counter()
        if outcome.errors:
            raise RuntimeError(f"constraint errors: {outcome.errors}")
        for row, token in zip(constrained[:rows], out.token_ids):
            row.output_token_ids.append(token)
            if row.request_id in outcome.finished or token in tokenizer.eos_token_ids:
                constraints.forget([row.request_id])
                row.output_token_ids = []
                restarts += 1
        if step >= 4:
            times["fill"].append(t1 - t0)
            times["apply"].append(t2 - t1)
            times["sample_masked"].append(spans[True])
            times["sample_free"].append(spans[False])
            times["accept"].append(t4 - t3)
    result = {name: ms(values) for name, values in times.items()}
    result["sample_overhead"] = result["sample_masked"] - result["sample_free"]
    result["total_overhead"] = result["fill"] + result["sample_overhead"] + result["accept"]
    result["grammars_finished"] = restarts
    return result


async def engine_itl(batch_sizes: list[int], steps: int, rounds: int) -> dict[int, dict[str, float]]:
    from metrale import AsyncEngine, EngineConfig

    messages = [{"role": "user", "content": "List many words as a JSON array of strings."}]
    results = {}
    keeper = RunnerKeeper()
    async with AsyncEngine(EngineConfig(max_num_seqs=64, kv_cache_bytes=512 << 20), runner_factory=keeper) as engine:
        warm = SamplingParams(max_tokens=4, structured_outputs={"json": LONG})
        await engine.prepare(warm)
        fills = timed(keeper.runner.constraints, "prepare")  # the host fill inside the real step
        steps_s = timed(keeper.runner, "execute", decode_only=True)  # whole decode steps (a benchmark may look)
        for b in batch_sizes:
            await asyncio.gather(*(run_one(engine, messages, warm) for _ in range(b)))  # compile per shape
            samples: dict[str, list[float]] = {"free": [], "constrained": []}
            fills.clear()
            for _round in range(rounds):  # alternate, so both modes see the same machine load
                for mode in ("free", "constrained") if _round % 2 == 0 else ("constrained", "free"):
                    params = [SamplingParams(max_tokens=steps, temperature=0.8, seed=i, ignore_eos=True,
                                             structured_outputs={"json": LONG} if mode == "constrained" else None)
                              for i in range(b)]
                    steps_s.clear()
                    await asyncio.gather(*(run_one(engine, messages, p) for p in params))
                    samples[mode].extend(steps_s)
            free, constrained = ms(samples["free"]), ms(samples["constrained"])
            fill = ms([f for f in fills if f > 1e-4] or [0.0])  # steps with constrained rows
            results[b] = {"free_ms": free, "constrained_ms": constrained, "overhead_ms": constrained - free,
                          "overhead_share": (constrained - free) / free, "fill_ms": fill, "rounds": rounds,
                          "steps": steps}
            print(f"engine B={b:2d}: decode step {free:7.1f} ms free, {constrained:7.1f} ms constrained "
                  f"({constrained - free:+.1f} ms, {100 * (constrained - free) / free:+.1f}%); host fill in the "
                  f"step {fill:.2f} ms", flush=True)
    return results


def timed(owner, name: str, decode_only: bool = False) -> list[float]:
    """Record the seconds of every call of owner.name (with decode_only: steps of one token per request)."""
    times: list[float] = []
    method = getattr(owner, name)

    def wrapper(arg):
        start = time.perf_counter()
        try:
            return method(arg)
        finally:
            if not decode_only or all(len(s.token_ids) == 1 for s in arg.scheduler_output.scheduled):
                times.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)
    return times


async def run_one(engine, messages, params) -> None:
    async for _ in engine.chat(messages, params):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                        help="micro: sample the rows greedily and/or at these temperatures")
    parser.add_argument("--extra-free-rows", type=int, default=0,
                        help="micro: unconstrained rows added to every batch (the masked-subset path)")
    parser.add_argument("--engine", action="store_true", help="also time the engine's decode step")
    parser.add_argument("--engine-steps", type=int, default=16, help="decode steps per request and round")
    parser.add_argument("--engine-rounds", type=int, default=6, help="free/constrained rounds, alternating")
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured_bench.json"))
    args = parser.parse_args()
    from tests.metrale.text_helpers import load_tokenizer

    tokenizer = load_tokenizer()
    compiler = GrammarCompiler(tokenizer.backend.to_str, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for schema in SCHEMAS:
        from metrale.structured_outputs import StructuredOutputs

        compiler.submit(StructuredOutputs(json=schema)).result()
    report: dict = {"vocab": compiler.n_vocab, "extra_free_rows": args.extra_free_rows, "micro": {}, "engine": {}}
    print(f"{'T':>4} {'rows':>4} {'fill':>8} {'apply':>8} {'sample+':>8} {'accept':>8} {'total':>8} "
          f"{'sample free':>12} (ms; + {args.extra_free_rows} free rows per batch)")
    for temperature in () if args.skip_micro else args.temperature:
        for rows in args.rows:
            r = micro(rows, args.steps, compiler, tokenizer, seed=rows, temperature=temperature,
                      extra_free=args.extra_free_rows)
            report["micro"][f"T={temperature:g} rows={rows}"] = r
            print(f"{temperature:4g} {rows:4d} {r['fill']:8.2f} {r['apply']:8.2f} {r['sample_overhead']:8.2f} "
                  f"{r['accept']:8.2f} {r['total_overhead']:8.2f} {r['sample_free']:12.2f}", flush=True)
    if args.engine:
        report["engine"] = asyncio.run(engine_itl(args.rows, args.engine_steps, args.engine_rounds))
    compiler.shutdown()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
