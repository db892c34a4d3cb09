"""Scheduler and Python overhead as a share of step time, at a given batch (issue: below 5% at 64).

    .venv/bin/python benchmarks/overhead.py --batch 64 --output-len 48

Runs `--batch` concurrent ignore_eos streams through the real engine and times, per step, the
event-loop work (schedule + postprocess: detokenize, stop strings, streams, metrics), the runner's
host-side work (building the step's arrays and the lazy graph, the sampler's host prep) and the MLX
evaluation. Only decode steps (every request past its prompt) are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.engine.startup import RunnerKeeper  # noqa: E402
from benchmarks.throughput import random_prompts  # noqa: E402


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.decode_steps = 0

    def wrap(self, obj, name: str, key: str):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - start
        setattr(obj, name, timed)


async def main(args: argparse.Namespace) -> dict:
    config = EngineConfig(max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch))
    keeper = RunnerKeeper()
    async with AsyncEngine(config, runner_factory=keeper) as engine:
        core, runner = engine._core, keeper.runner
        prompts = random_prompts(args.batch, args.prompt_len, runner.model_config.vocab_size, 0)
        params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
        streams = [engine.generate(p, params) for p in prompts]
        consumers = [asyncio.create_task(_drain(s)) for s in streams]
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler._running) or core.scheduler.num_waiting:
            await asyncio.sleep(0.005)  # let every prompt prefill first
        timers = Timers()
        original_eval = mx.eval
        timers.wrap(core.scheduler, "schedule", "schedule")
        timers.wrap(core, "_postprocess", "postprocess")
        timers.wrap(runner, "execute", "execute")
        eval_time = {"s": 0.0}

        def timed_eval(*a, **k):
            start = time.perf_counter()
            try:
                return original_eval(*a, **k)
            finally:
                eval_time["s"] += time.perf_counter() - start
        mx.eval = timed_eval
        steps_before = core.num_steps
        start = time.perf_counter()
        await asyncio.sleep(args.seconds)
        wall = time.perf_counter() - start
        steps = core.num_steps - steps_before
        mx.eval = original_eval
        for s in streams:
            s._abort(s.request_id)
        await asyncio.gather(*consumers, return_exceptions=True)
    t = timers.total
    loop_side = t["schedule"] + t["postprocess"]
    runner_host = t["execute"] - eval_time["s"]
    result = {"batch": args.batch, "steps": steps, "wall_s": round(wall, 2), "step_ms": round(wall / steps * 1e3, 1),
              "schedule_ms": round(t["schedule"] / steps * 1e3, 2), "postprocess_ms": round(t["postprocess"] / steps * 1e3, 2),
              "runner_host_ms": round(runner_host / steps * 1e3, 2), "mlx_eval_ms": round(eval_time["s"] / steps * 1e3, 1),
              "event_loop_share": round(loop_side / wall, 4), "python_share": round((loop_side + runner_host) / wall, 4)}
    return result


async def _drain(stream) -> None:
    async for _ in stream:
        pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=8.0)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=2))
