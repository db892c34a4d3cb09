"""Do running streams keep their pace while a long prompt is processed? ITL before/while, and its TTFT.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/long_prompt_itl_bench.py --variants none x2 ms60 --rounds 2

A variant is "none" (no time limit), "x<K>" (max_step_factor K: a step that decodes takes at most K times
its decodes' estimated time), "ms<N>" (max_step_ms N) or both joined by "+" ("x2+ms60"), with an optional
":f<N>" for min_prefill_chunk N ("x2:f1"; otherwise --min-prefill-chunk, default: the config's). Each is a
fresh process (`--worker`) with `--model` (default SmolLM2-135M Q4_1) in process. It starts `--streams` streams
(short random prompts, ignore_eos), records their inter-token gaps for `--baseline-tokens` tokens each, then
submits one random prompt of `--prompt-len` tokens (max_tokens=1) and records the streams' gaps until that
prompt's first token (its TTFT). Then it aborts the streams. A gap is the time between two deltas of a stream
divided by the tokens the second delta carries. It also logs every step the engine times while the prompt
runs: the scheduler's estimate and limit against the measured time (`step_*`: the measured time over the
estimate, the share of steps over their limit and their measured time over it at p50/p99, the measured step
p99), and the time Python's garbage collector paused (`gc_ms`). The streams' own step at their context (they
grow by a token a step while the prompt runs) is measured by the decode-only steps the scheduler runs during
the prompt (one per 16 chunk steps under a limit): `itl_over_same_context_*` is each gap over the 3 of them
nearest in time, `step_over_decode_*` each chunk step over them, `step_p99_over_decode_p99` the issue's
measure in one window, and `decode_noise_*` a decode-only step over its 3 nearest others: the machine's own
jitter, which no step limit can remove. Variants run alternately, round after round; the median per variant is reported
(the machine is shared, so load hits every variant alike).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_variant(variant: str, min_prefill_chunk: int | None) -> dict:
    """EngineConfig scheduling fields of a variant name (see the module docstring)."""
    spec, _, floor = variant.partition(":")
    fields: dict = {"max_step_ms": None, "max_step_factor": None}
    for part in spec.split("+"):
        if part.startswith("x"):
            fields["max_step_factor"] = float(part[1:])
        elif part.startswith("ms"):
            fields["max_step_ms"] = float(part[2:])
        elif part != "none":
            raise ValueError(f"variant {variant!r}: parts are none, x<factor> or ms<milliseconds>")
    if floor:
        fields["min_prefill_chunk"] = int(floor.removeprefix("f"))
    elif min_prefill_chunk is not None:
        fields["min_prefill_chunk"] = min_prefill_chunk
    return fields


class StepLog:
    """Every step the engine times: (end time, measured s, estimated s, limit s, long prompt tokens, step tokens,
    step attention pairs), and GC pauses."""

    def __init__(self, scheduler) -> None:
        from scheduler.step_cost import StepWork

        self.steps: list[tuple[float, float, float | None, float | None, int, int, int]] = []
        self.gc_pauses: list[tuple[float, float]] = []  # (end time, seconds)
        self._gc_started = 0.0
        observe = scheduler.observe_step

        def logged(output, seconds: float) -> None:
            chunk = sum(len(s.token_ids) for s in output.scheduled if s.request_id == "long")
            work = StepWork.of_output(output)
            self.steps.append((time.perf_counter(), seconds, scheduler.last_step_estimate, scheduler.last_step_limit,
                               chunk, work.num_tokens, work.num_attention_pairs))
            observe(output, seconds)

        scheduler.observe_step = logged
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        else:
            self.gc_pauses.append((now, now - self._gc_started))

    def decode_only(self, streams: int) -> list[tuple[float, float]]:
        """(end time, seconds) of the steps that decoded the `streams` streams and nothing else."""
        return [(s[0], s[1]) for s in self.steps if s[4] == 0 and s[5] == streams]

    def summary(self, start: float, end: float, streams: int) -> dict:
        gc.callbacks.remove(self._on_gc)
        steps = [s for s in self.steps if start < s[0] <= end]
        ratios = [s[1] / s[2] for s in steps if s[2]]
        limited = [s[1] / s[3] for s in steps if s[3]]
        chunks = [s[4] for s in steps if s[4]]
        decode_only = self.decode_only(streams)
        # a chunk step against the median of the 3 decode-only steps nearest in time: what the relative limit
        # bounds, at the streams' context and the machine's load of that moment
        over_decode = [s[1] / near_decode_step(decode_only, s[0], 3) for s in steps if s[4] and decode_only]
        # the machine's own noise: a decode-only step of the window against the 3 others nearest in time
        during = [d for d in decode_only if start < d[0] <= end]
        noise = [d[1] / near_decode_step([o for o in decode_only if o is not d], d[0], 3) for d in during] \
            if len(decode_only) >= 4 else []
        nan = float("nan")
        return {"steps": len(steps), "step_p50_ms": 1e3 * statistics.median(s[1] for s in steps),
                "step_p99_ms": 1e3 * percentile([s[1] for s in steps], 0.99),
                "step_over_estimate_p50": statistics.median(ratios) if ratios else nan,
                "step_over_estimate_p99": percentile(ratios, 0.99) if ratios else nan,
                "steps_over_limit": sum(r > 1 for r in limited) / len(limited) if limited else nan,
                "step_over_limit_p50": statistics.median(limited) if limited else nan,
                "step_over_limit_p99": percentile(limited, 0.99) if limited else nan,
                "limit_p50_ms": 1e3 * statistics.median(s[3] for s in steps if s[3]) if limited else nan,
                "step_over_decode_p50": statistics.median(over_decode) if over_decode else nan,
                "step_over_decode_p90": percentile(over_decode, 0.9) if over_decode else nan,
                "step_over_decode_p99": percentile(over_decode, 0.99) if over_decode else nan,
                "decode_noise_p90": percentile(noise, 0.9) if noise else nan,
                "decode_noise_p99": percentile(noise, 0.99) if noise else nan,
                # the issue's measure, in one window: the streams' step p99 over their decode-only step p99
                "step_p99_over_decode_p99": percentile([s[1] for s in steps], 0.99) / percentile([d[1] for d in during], 0.99)
                if len(during) >= 3 else nan,
                "chunk_p50": statistics.median(chunks) if chunks else 0.0,
                "gc_ms": 1e3 * sum(seconds for t, seconds in self.gc_pauses if start < t <= end)}


def near_decode_step(decode_only: list[tuple[float, float]], when: float, count: int) -> float:
    """The median seconds of the `count` decode-only steps that ended nearest to `when`."""
    nearest = sorted(decode_only, key=lambda step: abs(step[0] - when))[:count]
    return statistics.median(seconds for _, seconds in nearest)


async def measure(model: str | None, scheduling: dict, streams: int, prompt_len: int, baseline_tokens: int,
                  seed: int) -> dict:
    from metrale import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(model=model, max_num_seqs=max(8, streams + 1), max_model_len=prompt_len + 1, **scheduling)
    rng = random.Random(seed)
    async with AsyncEngine(config) as engine:
        await engine.complete([rng.randrange(100, 4000) for _ in range(600)], SamplingParams(max_tokens=4))
        log = StepLog(engine._core.scheduler)  # in process: the core is there
        gaps: list[list[tuple[float, float]]] = [[] for _ in range(streams)]  # (time of delta, gap per token)
        params = SamplingParams(max_tokens=prompt_len + 1 - 16, ignore_eos=True, temperature=0)

        async def stream(i: int) -> None:
            last = None
            async for out in engine.generate([rng.randrange(100, 4000) for _ in range(16)], params,
                                             request_id=f"s{i}"):
                now = time.perf_counter()
                if last is not None and out.token_ids:
                    gaps[i].append((now, (now - last) / len(out.token_ids)))
                if out.token_ids:
                    last = now

        tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
        while min(len(g) for g in gaps) < baseline_tokens:
            await asyncio.sleep(0.05)
        submitted = time.perf_counter()
        long_prompt = [rng.randrange(100, 4000) for _ in range(prompt_len)]
        async for out in engine.generate(long_prompt, SamplingParams(max_tokens=1), request_id="long"):
            if out.token_ids:
                break
        first_token = time.perf_counter()
        for i in range(streams):
            engine.abort(f"s{i}")
        await asyncio.gather(*tasks)
    before = [gap for g in gaps for t, gap in g[2:] if t < submitted]  # the first gaps include warm-up
    during = [(t, gap) for g in gaps for t, gap in g if submitted < t <= first_token]
    # the same-context baseline: each gap against the decode-only steps nearest in time (the scheduler runs one
    # every 16 chunk steps under a limit): the streams' own decode step at their context and the load of then;
    # the "before" gaps are at a shorter context (the streams grow by a token a step while the prompt runs)
    decode_only = log.decode_only(streams)
    same_context = [gap / near_decode_step(decode_only, t, 3) for t, gap in during] if len(decode_only) >= 3 else []
    gaps_during = [gap for _, gap in during]
    return {"itl_before_p50_ms": 1e3 * statistics.median(before), "itl_before_p99_ms": 1e3 * percentile(before, 0.99),
            "itl_during_p50_ms": 1e3 * statistics.median(gaps_during),
            "itl_during_p99_ms": 1e3 * percentile(gaps_during, 0.99), "itl_during_max_ms": 1e3 * max(gaps_during),
            "itl_over_same_context_p50": statistics.median(same_context) if same_context else float("nan"),
            "itl_over_same_context_p99": percentile(same_context, 0.99) if same_context else float("nan"),
            "long_ttft_s": first_token - submitted, "tokens_during": len(during),
            **log.summary(submitted, first_token, streams)}, log.steps


def run_variant(variant: str, args) -> dict:
    cmd = [sys.executable, str(HERE), "--worker", "--variants", variant, "--streams", str(args.streams),
           "--prompt-len", str(args.prompt_len), "--baseline-tokens", str(args.baseline_tokens)]
    if args.min_prefill_chunk is not None:
        cmd += ["--min-prefill-chunk", str(args.min_prefill_chunk)]
    if args.model is not None:
        cmd += ["--model", args.model]
    if args.steps_out is not None:
        args.steps_out.mkdir(parents=True, exist_ok=True)
        cmd += ["--steps-out", str(args.steps_out / f"{variant}-{time.strftime('%H%M%S')}.json")]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["none", "x2"], help="none, x<K>, ms<N>, x<K>+ms<N>; :f<N> floor")
    p.add_argument("--model", help="GGUF path (default: the engine's default model)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--min-prefill-chunk", type=int, help="default: the config's")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--baseline-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, help="write every round's numbers as JSON here")
    p.add_argument("--steps-out", type=Path, help="a folder: each run's steps as JSON (end time, measured s, "
                   "estimate s, limit s, long prompt tokens, step tokens, attention pairs)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        (variant,) = args.variants
        result, steps = asyncio.run(measure(args.model, parse_variant(variant, args.min_prefill_chunk), args.streams,
                                            args.prompt_len, args.baseline_tokens, seed=0))
        if args.steps_out is not None:
            args.steps_out.write_text(json.dumps(steps) + "\n")
        print("RESULT " + json.dumps(result), flush=True)
        return
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for variant in args.variants:
            runs[variant].append(run_variant(variant, args))
            print(f"round {r + 1} {variant}: {runs[variant][-1]}", file=sys.stderr, flush=True)
    keys = list(next(iter(runs.values()))[0])
    print(f"median of {args.rounds} alternating rounds; {args.streams} streams, one {args.prompt_len}-token prompt")
    for k in keys:  # one row per measure: the variants side by side
        print(f"{k:>24s} " + " ".join(f"{statistics.median(x[k] for x in rs):>10.3g}" for rs in runs.values()))
    print(f"{'variant':>24s} " + " ".join(f"{v:>10s}" for v in runs))
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
