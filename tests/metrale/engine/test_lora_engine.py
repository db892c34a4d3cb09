"""LoRA adapters through the engine: per-request adapters batched with each other and with the base model, in
process and in the engine process; the prefix cache never shares blocks across adapters; max_loras bounds the
resident adapters (LRU, reloaded from the folder); unknown names and bad folders are typed refusals."""

from __future__ import annotations

import asyncio
import json

import pytest

from metrale import LLM, AsyncEngine, EngineConfig, SamplingParams
from metrale.errors import InvalidLoraAdapterError, LoraNotFoundError, RequestFailedError
from metrale.loading import load_model
from tests.metrale.engine_helpers import Runners, assert_clean, collect, wait_idle
from tests.metrale.lora_helpers import random_adapter, write_mlx_adapter, write_peft_adapter

pytestmark = [pytest.mark.timeout(120)]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13, 70, 21, 8]
OTHER = [3, 14, 15, 92, 65, 35, 89, 79]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
MODES = [pytest.param(False, id="in-process"), pytest.param(True, id="engine-process")]


def config(model: str, engine_process: bool = False, **kw) -> EngineConfig:
    kw = {"kv_cache_bytes": 2 << 20, "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 128,
          "max_model_len": 512, **kw}
    return EngineConfig(model=model, engine_process=engine_process, **kw)


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory) -> dict[str, str]:
    """Three adapters of the tiny model: A (mlx-lm layout, rank 4), B (PEFT, rank 8), C (mlx-lm, rank 2)."""
    model_config = load_model(tiny_model).config
    root = tmp_path_factory.mktemp("adapters")
    return {
        "A": str(write_mlx_adapter(root / "A", random_adapter(model_config, 4, seed=1), rank=4, scale=2.0)),
        "B": str(write_peft_adapter(root / "B", random_adapter(model_config, 8, seed=2), rank=8, alpha=16.0)),
        "C": str(write_mlx_adapter(root / "C", random_adapter(model_config, 2, seed=3), rank=2, scale=3.0)),
    }


async def tokens(engine: AsyncEngine, prompt=PROMPT, lora: str | None = None) -> list[int]:
    return (await collect(engine.generate(prompt, GREEDY, lora=lora)))[0]


@pytest.mark.parametrize("engine_process", MODES)
async def test_a_row_in_a_mixed_batch_equals_a_lone_request(tiny_model, adapters, engine_process):
    async with AsyncEngine(config(tiny_model, engine_process)) as engine:
        for name in ("A", "B"):
            await engine.add_lora(name, adapters[name])
        assert set(engine.list_loras()) == {"A", "B"}
        lone_a, lone_b, base = await tokens(engine, lora="A"), await tokens(engine, OTHER, lora="B"), await tokens(engine)
        streams = [engine.generate(PROMPT, GREEDY, lora="A"), engine.generate(OTHER, GREEDY, lora="B"),
                   engine.generate(PROMPT, GREEDY), engine.generate(PROMPT, GREEDY, lora="A")]
        mixed = [r[0] for r in await asyncio.gather(*(collect(s) for s in streams))]
        assert mixed == [lone_a, lone_b, base, lone_a]
        assert lone_a != base
        await wait_idle(engine)
        assert_clean(engine)


async def test_the_prefix_cache_never_shares_blocks_across_adapters(tiny_model, adapters):
    async with AsyncEngine(config(tiny_model)) as engine:
        await engine.add_lora("A", adapters["A"])
        base = await tokens(engine)
        hits = engine.stats().prefix_cache_hits
        first_a = await tokens(engine, lora="A")
        assert engine.stats().prefix_cache_hits == hits  # the base model's blocks of this prompt are not A's
        again_a = await tokens(engine, lora="A")
        assert engine.stats().prefix_cache_hits > hits  # A's own blocks are
        hits = engine.stats().prefix_cache_hits
        assert await tokens(engine) == base and engine.stats().prefix_cache_hits > hits
        assert first_a == again_a != base
        await wait_idle(engine)
        assert_clean(engine)


async def test_max_loras_bounds_resident_adapters_and_evicts_the_least_recently_used(tiny_model, adapters):
    runners = Runners()
    async with AsyncEngine(config(tiny_model, max_loras=1, enable_prefix_caching=False),
                           runner_factory=runners) as engine:
        for name in ("A", "B"):
            await engine.add_lora(name, adapters[name])
        lone = {name: await tokens(engine, lora=name) for name in ("A", "B")}
        lora = runners.runner.lora
        assert lora.resident == ("B",) and lora.num_loads == 2
        streams = [engine.generate(PROMPT, GREEDY, lora=name) for name in ("A", "B", "A", "B")]
        results = [r[0] for r in await asyncio.gather(*(collect(s) for s in streams))]
        assert results == [lone["A"], lone["B"], lone["A"], lone["B"]]  # one adapter at a time, none evicted mid-run
        assert lora.num_loads == 6  # arrival order: A, B, A, B each reloaded from its folder after the other ran
        await wait_idle(engine)
        assert_clean(engine)


async def test_unknown_adapters_and_bad_folders_are_typed_refusals(tiny_model, adapters, tmp_path):
    async with AsyncEngine(config(tiny_model, max_lora_rank=4)) as engine:
        with pytest.raises(LoraNotFoundError):
            engine.generate(PROMPT, GREEDY, lora="nope")
        with pytest.raises(InvalidLoraAdapterError, match="not a folder"):
            await engine.add_lora("X", str(tmp_path / "missing"))
        with pytest.raises(InvalidLoraAdapterError, match="max_lora_rank"):
            await engine.add_lora("B", adapters["B"])  # rank 8 > 4
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
        with pytest.raises(InvalidLoraAdapterError, match="adapter_model.safetensors"):
            await engine.add_lora("bad", str(bad))
        assert engine.list_loras() == {}
        await engine.add_lora("A", adapters["A"])
        with pytest.raises(InvalidLoraAdapterError, match="already loaded"):
            await engine.add_lora("A", adapters["C"])
        assert engine.remove_lora("A") and not engine.remove_lora("A")
        with pytest.raises(LoraNotFoundError):
            engine.generate(PROMPT, GREEDY, lora="A")
        assert engine.stats().requests_unfinished == 0
        assert_clean(engine)


async def test_max_lora_adapters_bounds_the_registry_before_reading_a_folder(tiny_model, adapters, tmp_path):
    async with AsyncEngine(config(tiny_model, max_lora_adapters=2)) as engine:
        await engine.add_lora("A", adapters["A"])
        await engine.add_lora("B", adapters["B"])
        await engine.add_lora("A", adapters["A"])  # the same again: nothing new is registered
        for name, folder in (("C", adapters["C"]), ("X", str(tmp_path / "missing"))):
            with pytest.raises(InvalidLoraAdapterError, match=r"at most 2 LoRA adapters are registered "
                                                              r"\(max_lora_adapters\); unload one first"):
                await engine.add_lora(name, folder)  # the limit, not "not a folder": refused before reading it
        assert set(engine.list_loras()) == {"A", "B"}
        assert engine.remove_lora("A")
        await engine.add_lora("C", adapters["C"])
        assert set(engine.list_loras()) == {"B", "C"}


def test_max_lora_adapters_is_validated():
    with pytest.raises(ValueError, match="max_lora_adapters must be an int >= 1"):
        EngineConfig(max_lora_adapters=0)


def test_llm_takes_one_adapter_per_prompt(tiny_model, adapters):
    with LLM(config(tiny_model)) as llm:
        llm.add_lora("A", adapters["A"])
        (lone,) = llm.generate(PROMPT, GREEDY, lora="A")
        mixed = llm.generate([PROMPT, PROMPT], GREEDY, lora=["A", None])
        assert mixed[0].token_ids == lone.token_ids != mixed[1].token_ids
        with pytest.raises(ValueError, match="one per prompt"):
            llm.generate([PROMPT, PROMPT], GREEDY, lora=["A"])
        assert llm.remove_lora("A")
        with pytest.raises(LoraNotFoundError):
            llm.generate(PROMPT, GREEDY, lora="A")


@pytest.mark.real_model
@pytest.mark.timeout(600)
async def test_quantized_default_model_mixed_batch_equals_lone(tmp_path):
    """SmolLM2-135M Q4_1 on the CPU kernels (fused qkv and gate/up): adapters A and B and the base in one batch."""
    model_config = load_model(None).config
    paths = {"A": write_mlx_adapter(tmp_path / "A", random_adapter(model_config, 8, seed=1), rank=8, scale=0.5),
             "B": write_peft_adapter(tmp_path / "B", random_adapter(model_config, 16, seed=2), rank=16, alpha=8.0)}
    prompt = list(range(1000, 1024))
    async with AsyncEngine(EngineConfig(kv_cache_bytes=64 << 20, max_model_len=512)) as engine:
        for name, path in paths.items():
            await engine.add_lora(name, str(path))
        lone = {name: await tokens(engine, prompt, lora=name) for name in ("A", "B", None)}
        streams = [engine.generate(prompt, GREEDY, lora=name) for name in ("A", "B", None, "A")]
        mixed = [r[0] for r in await asyncio.gather(*(collect(s) for s in streams))]
        assert mixed == [lone["A"], lone["B"], lone[None], lone["A"]]
        assert lone["A"] != lone[None] and lone["B"] != lone[None]
        await wait_idle(engine)
        assert_clean(engine)


async def test_an_adapter_that_no_longer_loads_fails_its_requests_alone(tiny_model, adapters, tmp_path):
    import shutil

    folder = tmp_path / "gone"
    shutil.copytree(adapters["A"], folder)
    async with AsyncEngine(config(tiny_model)) as engine:
        await engine.add_lora("gone", str(folder))
        base = await tokens(engine)
        shutil.rmtree(folder)  # registered, then deleted before its first request loads it
        doomed = engine.generate(PROMPT, GREEDY, lora="gone")
        fine = engine.generate(PROMPT, GREEDY)
        with pytest.raises(RequestFailedError, match="not a folder"):
            await collect(doomed)
        assert (await collect(fine))[0] == base
        await wait_idle(engine)
        assert_clean(engine)
