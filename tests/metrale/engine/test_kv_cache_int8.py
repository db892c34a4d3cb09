"""EngineConfig.kv_cache_dtype="int8": q8 KV pools (kvcache/quantized.py) hold 1.88x float16's tokens in the
same kv_cache_bytes; prefix caching, forks, speculation and LoRA run on them unchanged and free every
block; on the real default model the greedy tokens and last-position logits stay near float16's."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from kvcache import quantized
from kvcache.storage import PagedKVCache
from metrale import AsyncEngine, EngineConfig, SamplingParams
from metrale.engine.runner import resolve_kv_dtype
from metrale.loading import load_model
from metrale.models.cpu_quantized import set_activation_bits
from tests.metrale.engine.test_kv_cache_dtype import BLOCK, PROMPTS, greedy, kv_caches_in_one_budget
from tests.metrale.engine_helpers import assert_clean, collect, wait_idle
from tests.metrale.lora_helpers import random_adapter, write_mlx_adapter

pytestmark = [pytest.mark.timeout(120)]

PROMPT = [5, 30, 7, 60, 11, 40, 9, 50, 13, 70, 21, 8, 33, 44]  # 3 full blocks of 4 and a partial one
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, "adaptive": False}
# Real default model, int8 vs float16 KV, last-position logits: max |diff| / (max - min of float16's logits).
# Measured 0.0042..0.0063 (mean |diff| 0.0007..0.0015 of the range) on PROMPTS and a 408-token prompt; per head
# vector scales (66-byte rows) doubled both and changed greedy tokens (kvcache/quantized.py, GROUP).
MAX_DIFF_OF_RANGE = 0.02
MEAN_DIFF_OF_RANGE = 0.004


def test_int8_is_a_kv_cache_dtype():
    assert EngineConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert resolve_kv_dtype("int8", mx.float32) == mx.int8


def test_int8_holds_1_88x_the_blocks_of_float16_in_the_same_budget(tmp_path):
    caches = kv_caches_in_one_budget(tmp_path, ("float16", "int8"))
    half, q8 = caches["float16"], caches["int8"]
    assert q8.dtype == mx.int8 and q8.bytes <= 1 << 20 and q8.row_width == quantized.row_width(q8.head_dim)
    per_block = PagedKVCache.bytes_per_block(q8.num_layers, 4, q8.n_kv_heads, q8.head_dim, mx.int8)
    assert q8.num_blocks == (1 << 20) // per_block  # the scales are counted
    ratio = 2 * q8.head_dim / q8.row_width  # bytes per value of float16 over int8 with its scales
    assert q8.num_blocks == pytest.approx(half.num_blocks * ratio, abs=1) and ratio > 1.75


def engine_config(model: str, **kw) -> EngineConfig:
    kw = {"kv_cache_bytes": 2 << 20, "block_size": 4, "max_num_seqs": 16, "max_num_batched_tokens": 128,
          "max_model_len": 512, "kv_cache_dtype": "int8", **kw}
    return EngineConfig(model=model, **kw)


async def test_prefix_cache_forks_speculation_and_lora_on_int8_pools(tiny_model, tmp_path):
    adapter = write_mlx_adapter(tmp_path / "A", random_adapter(load_model(tiny_model).config, 4, seed=1), rank=4,
                                scale=2.0)
    async with AsyncEngine(engine_config(tiny_model)) as engine:
        alone = await collect(engine.generate(PROMPT, GREEDY))
        hits = engine.stats().prefix_cache_hits
        again = await collect(engine.generate(PROMPT, GREEDY))  # the prompt's full blocks come from the cache
        assert again == alone and engine.stats().prefix_cache_hits > hits
        forked = engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, n=3))
        ids: dict[int, list[int]] = {}
        async for out in forked:  # three sequences share the prompt's blocks, copy the partial one
            ids.setdefault(out.index, []).extend(out.token_ids)
        assert ids == {i: alone[0] for i in range(3)}
        await engine.add_lora("A", str(adapter))
        with_lora, base = await asyncio.gather(collect(engine.generate(PROMPT, GREEDY, lora="A")),
                                               collect(engine.generate(PROMPT, GREEDY)))
        assert base == alone and with_lora != alone
        await wait_idle(engine)
        assert_clean(engine)
    async with AsyncEngine(engine_config(tiny_model, speculative_config=SPEC)) as engine:
        speculated = await collect(engine.generate(PROMPT, GREEDY))  # rejected drafts roll back int8 slots
        assert speculated == alone
        await wait_idle(engine)
        assert_clean(engine)


@pytest.mark.real_model
async def test_int8_engine_keeps_float16_greedy_tokens_on_the_default_model():
    """The whole engine on the default model: PROMPTS, 24 greedy tokens each, int8 vs float16 KV."""
    results = {}
    for dtype in ("float16", "int8"):
        config = EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=4, kv_cache_dtype=dtype)
        async with AsyncEngine(config) as engine:
            params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            results[dtype] = await asyncio.gather(*(collect(engine.generate(p, params)) for p in PROMPTS))
            blocks = engine.stats().kv_blocks_total
            await wait_idle(engine)
            assert_clean(engine)
        results[dtype + " blocks"] = blocks
    diverged = [(p[:30], a[1], b[1]) for p, a, b in zip(PROMPTS, results["float16"], results["int8"]) if a != b]
    assert not diverged, diverged
    assert results["int8 blocks"] == pytest.approx(results["float16 blocks"] * 128 / 68, abs=1)


@pytest.mark.real_model
def test_int8_last_position_logits_stay_near_float16_on_the_default_model():
    """Each test prompt and a 408-token prompt prefilled in chunks of 96 over cached int8 KV: the
    last-position logits and 16 greedy tokens against a float16 cache."""
    loaded = load_model(None, dtype=None)
    # int16 activations isolate the KV dtype's effect (the bounds were measured so): the default int12's
    # coarser rounding turns a tiny KV difference at a rounding edge into a larger logit one
    set_activation_bits(loaded.model, 16)
    mc = loaded.config
    shape = (mc.num_hidden_layers, 64, BLOCK, mc.num_key_value_heads, mc.head_dim)
    long_prompt = " ".join(PROMPTS * 8)
    report, mismatches = [], []
    for text, chunk in [(p, 512) for p in PROMPTS] + [(long_prompt, 96)]:
        prompt = loaded.tokenizer.encode(text)
        base_logits, base = greedy(loaded.model, PagedKVCache(*shape, dtype=mx.float16), prompt, 16, chunk)
        q8_logits, q8 = greedy(loaded.model, PagedKVCache(*shape, dtype=mx.int8), prompt, 16, chunk)
        span = float(base_logits.max() - base_logits.min())
        diff = np.abs(q8_logits - base_logits)
        report.append((len(prompt), float(diff.max()) / span, float(diff.mean()) / span))
        if q8 != base:
            mismatches.append((text[:30], base, q8))
    print(f"int8 vs float16 KV: (prompt tokens, max diff / range, mean diff / range) {report}")
    assert any(n >= 400 for n, _, _ in report)
    assert max(r[1] for r in report) <= MAX_DIFF_OF_RANGE, report
    assert max(r[2] for r in report) <= MEAN_DIFF_OF_RANGE, report
    assert not mismatches, mismatches


def test_gemma2_soft_capped_attention_reads_int8_pools_as_their_dequantized_values():
    """gemma2's own attention (gathered rows, capped scores) over an int8 cache equals it over a float32
    cache holding the dequantized values, on a decode + chunk step."""
    from kvcache.attention import AttentionMetadata
    from metrale.models.gemma2 import softcapped_paged_attention

    rng = np.random.default_rng(0)
    n_kv, hd, bs = 2, 64, 4
    tables, contexts, query_lens = [[3, 0, 5], [1, 2, 4, 6]], [9, 14], [1, 6]
    q8 = PagedKVCache(1, 8, bs, n_kv, hd, dtype=mx.int8)
    wide = PagedKVCache(1, 8, bs, n_kv, hd, dtype=mx.float32)
    for table, ctx in zip(tables, contexts):
        pos = np.arange(ctx)
        slots = mx.array((np.asarray(table)[pos // bs] * bs + pos % bs).astype(np.int32))
        k, v = (mx.array(rng.standard_normal((ctx, n_kv, hd)).astype(np.float32)) for _ in range(2))
        q8.write(0, k, v, slots)
        wide.write(0, quantized.dequantize(quantized.quantize(k), hd), quantized.dequantize(quantized.quantize(v), hd),
                   slots)
    queries = mx.array(rng.standard_normal((sum(query_lens), 6, hd)).astype(np.float32))
    md = AttentionMetadata.build(query_lens, contexts, tables, bs)
    got = softcapped_paged_attention(queries, *q8.layer(0), md, 0.125, 30.0, None)
    want = softcapped_paged_attention(queries, *wide.layer(0), md, 0.125, 30.0, None)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
