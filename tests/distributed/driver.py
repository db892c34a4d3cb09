"""Rank 0 of a two-rank test group, as its own process (mx.distributed holds one ring group per
process, so every scenario runs in a fresh one): `python -m tests.distributed.driver SCENARIO ARGS`.
Prints one JSON line with what it saw; the test compares it.

    forward MODEL            the sharded forward's logits vs the unsharded model's, over a few steps
    engine MODEL KV_BYTES    greedy requests through AsyncEngine(tensor_parallel_size=2): tokens,
                             an abort, preemptions, the KV integrity check
    rank_dies MODEL KILL|STOP   a follower killed (or stopped) mid-generation: errors, health
    refused MODEL N          start() at a size that does not divide the heads: the error, nothing left running
    greedy MODEL|default N   24 greedy tokens for three text prompts at tensor_parallel_size N
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import sys
import time

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402

from kvcache.storage import PagedKVCache  # noqa: E402
from metrale.distributed.group import TensorParallelGroup  # noqa: E402
from metrale.engine.step import ForwardInput  # noqa: E402
from metrale.loading import load_model  # noqa: E402

BLOCK_SIZE = 4
GREEDY_PROMPTS = ["The capital of France is", "def fib(n):", "Once upon a time"]
FORK_PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13, 70, 21, 8, 33, 44]  # 3 full blocks of 4 and a partial one


def _forwards() -> list[ForwardInput]:
    """Two sequences: a prefill of 7 and one of 5 tokens, then two decode steps, then a chunk."""
    tables = ((3, 0, 5), (1, 4, 2))  # non-contiguous blocks, 12 slots each
    steps = [
        ([11, 12, 13, 14, 15, 16, 17, 21, 22, 23, 24, 25], (7, 5), (7, 5)),
        ([31, 41], (1, 1), (8, 6)),
        ([32, 42], (1, 1), (9, 7)),
        ([33, 34, 43, 44, 45], (2, 3), (11, 10)),
    ]
    return [ForwardInput(tuple(ids), q, c, tables, BLOCK_SIZE) for ids, q, c in steps]


def forward_scenario(model: str, dtype_name: str) -> dict:
    dtype = None if dtype_name == "auto" else getattr(mx, dtype_name)
    group = TensorParallelGroup(2, step_timeout=60)
    group.spawn(model, dtype)
    try:
        asyncio.run(group.wait_joining())
        group.join()
        sharded = load_model(model, dtype=dtype, shard=group.shard)
        full = load_model(model, dtype=dtype)
        mc = sharded.config
        caches = [PagedKVCache(mc.num_hidden_layers, 8, BLOCK_SIZE, heads, mc.head_dim, sharded.dtype)
                  for heads in (mc.num_key_value_heads // 2, mc.num_key_value_heads)]
        group.start_steps(8, BLOCK_SIZE)
        errors, scale = [], []
        for forward in _forwards():
            def step(forward=forward):
                group.send_forward(forward)
                hidden = forward.run(sharded.model, caches[0], None)
                logits = sharded.model.compute_logits(hidden)
                mx.eval(logits)
                group.forward_launched()
                return logits

            logits = group.run_step(step)
            reference = full.model.compute_logits(forward.run(full.model, caches[1], None))
            errors.append(mx.abs(logits - reference).max().item())
            scale.append(mx.abs(reference).max().item())
        return {"max_abs_error": errors, "max_abs_logit": scale, "quantization": sharded.describe_quantization(),
                "kv_heads_per_rank": caches[0].layer(0)[0].shape[1]}
    finally:
        group.close()


async def engine_scenario(model: str, kv_bytes: int) -> dict:
    from metrale import AsyncEngine, EngineConfig, SamplingParams
    from tests.metrale.engine_helpers import assert_clean, collect, wait_idle

    SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    config = EngineConfig(model=model, tensor_parallel_size=2, kv_cache_bytes=kv_bytes, block_size=BLOCK_SIZE,
                          max_model_len=256, max_num_seqs=8, enable_prefix_caching=False)
    async with AsyncEngine(config) as engine:
        greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = {f"r{i}": [3 + (7 * i + j) % 90 for j in range(5 + 3 * i)] for i in range(6)}
        streams = {rid: engine.generate(ids, greedy, request_id=rid) for rid, ids in prompts.items()}
        victim = engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                                 request_id="victim")
        tasks = {rid: asyncio.create_task(collect(stream)) for rid, stream in streams.items()}
        victim_task = asyncio.create_task(collect(victim))
        while engine.stats().num_steps < 3:
            await asyncio.sleep(0.01)
        engine.abort("victim")
        results = {rid: (await task)[0] for rid, task in tasks.items()}
        victim_ids, _, victim_finish = await victim_task
        lone, _, _ = await collect(engine.generate(FORK_PROMPT, SHORT))
        forked: dict[int, list[int]] = {}  # n=3 forks one computed prompt: its partial block is copied on every rank
        async for out in engine.generate(FORK_PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                                     n=3)):
            forked.setdefault(out.index, []).extend(out.token_ids)
        await wait_idle(engine)
        assert_clean(engine)
        stats = engine.stats()
        return {"prompts": prompts, "tokens": results, "victim_finish": victim_finish, "lone": lone,
                "forked": [forked[i] for i in range(3)],
                "victim_tokens": len(victim_ids), "preemptions": stats.num_preemptions,
                "kv_blocks": stats.kv_blocks_total, "health": engine.health()}


async def rank_dies_scenario(model: str, how: str) -> dict:
    from metrale import AsyncEngine, EngineConfig, SamplingParams
    from metrale.errors import EngineDeadError, RequestFailedError
    from tests.metrale.engine_helpers import Runners, assert_clean

    config = EngineConfig(model=model, tensor_parallel_size=2, kv_cache_bytes=4 << 20, block_size=BLOCK_SIZE,
                          max_model_len=512)
    runners = Runners()
    engine = AsyncEngine(config, runner_factory=runners)
    await engine.start()
    follower = runners.runner.group.followers[0]
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    streams = [engine.generate([5 + i, 6, 7], params) for i in range(3)]
    outcomes = []

    async def consume(stream):
        count = 0
        try:
            async for out in stream:
                count += len(out.token_ids)
        except RequestFailedError as error:
            return {"tokens": count, "error": str(error)}
        return {"tokens": count, "error": None}

    tasks = [asyncio.create_task(consume(s)) for s in streams]
    while engine.stats().num_steps < 5:
        await asyncio.sleep(0.01)
    os.kill(follower.pid, signal.SIGKILL if how == "KILL" else signal.SIGSTOP)
    killed_at = time.monotonic()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    ended_s = time.monotonic() - killed_at
    health = engine.health()
    try:
        engine.generate([5, 6], params)
        refused = None
    except EngineDeadError as error:
        refused = str(error)
    assert_clean(engine)
    await engine.shutdown()
    return {"outcomes": outcomes, "ended_s": ended_s, "health": health, "refused": refused,
            "follower_status": follower.process.poll()}


async def greedy_scenario(model: str, size: int) -> dict:
    from metrale import AsyncEngine, EngineConfig, SamplingParams

    config = EngineConfig(model=None if model == "default" else model, tensor_parallel_size=size,
                          kv_cache_bytes=64 << 20)
    async with AsyncEngine(config) as engine:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        results = await asyncio.gather(*(engine.complete(p, params) for p in GREEDY_PROMPTS))
        return {"tokens": [r.token_ids for r in results]}


async def refused_scenario(model: str, size: int) -> dict:
    from metrale import AsyncEngine, EngineConfig

    engine = AsyncEngine(EngineConfig(model=model, tensor_parallel_size=size))
    try:
        await engine.start()
    except ValueError as error:
        return {"error": str(error), "health": engine.health()}
    await engine.shutdown()
    return {"error": None}


def main() -> None:
    faulthandler.dump_traceback_later(float(os.environ.get("TP_DRIVER_DUMP_AFTER_S", "100")), exit=True)
    scenario, *args = sys.argv[1:]
    if scenario == "forward":
        result = forward_scenario(args[0], args[1] if len(args) > 1 else "auto")
    elif scenario == "engine":
        result = asyncio.run(engine_scenario(args[0], int(args[1])))
    elif scenario == "refused":
        result = asyncio.run(refused_scenario(args[0], int(args[1])))
    elif scenario == "greedy":
        result = asyncio.run(greedy_scenario(args[0], int(args[1])))
    elif scenario == "rank_dies":
        result = asyncio.run(rank_dies_scenario(args[0], args[1]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # skip the teardown where a thread's MLX random key can abort (kernels.runtime.release_thread_state)


if __name__ == "__main__":
    main()
