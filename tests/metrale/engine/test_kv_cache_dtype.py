"""EngineConfig.kv_cache_dtype: 16-bit KV pools on CPU hold twice the tokens in the same budget and,
on the real default model, give float32's greedy tokens with first-step logits within LOGITS_BOUND."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvcache.storage import PagedKVCache
from metrale.config import EngineConfig
from metrale.engine.runner import ModelRunner, resolve_kv_dtype
from metrale.engine.step import ForwardInput
from tests.metrale.model_helpers import make_twins, tiny_config_dict, write_tiny_gguf

BLOCK = 16
# max |logit(float16 cache) - logit(float32 cache)| at the first sampled position of each test prompt on
# SmolLM2-135M Q4_1 (measured: see the test's assertion message); logits span about +-30 there
LOGITS_BOUND = {mx.float16: 0.05, mx.bfloat16: 0.5}
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a robot who learns to paint. Once upon a time,",
    "List three facts about the moon:\n1.",
)


def test_config_rejects_unknown_kv_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig().kv_cache_dtype == "auto"


def test_auto_is_float16_on_cpu_for_float32_activations():
    assert mx.default_device() == mx.cpu
    assert resolve_kv_dtype("auto", mx.float32) == mx.float16
    assert resolve_kv_dtype("auto", mx.bfloat16) == mx.bfloat16  # 16-bit activations keep their own dtype
    assert resolve_kv_dtype("float32", mx.float32) == mx.float32
    assert resolve_kv_dtype("bfloat16", mx.float32) == mx.bfloat16


def kv_caches_in_one_budget(tmp_path, dtypes: tuple[str, ...]) -> dict:
    """The KV cache a tiny model's runner allocates from 1 MiB with blocks of 4, per kv_cache_dtype name."""
    config_dict = tiny_config_dict()
    _, model = make_twins(config_dict)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), config_dict, tree_flatten(model.parameters()))
    return {name: ModelRunner.load(EngineConfig(model=str(path), kv_cache_bytes=1 << 20, block_size=4,
                                                kv_cache_dtype=name)).kv_cache
            for name in dtypes}


def test_sixteen_bits_hold_twice_the_blocks_in_the_same_budget(tmp_path):
    caches = kv_caches_in_one_budget(tmp_path, ("float32", "float16", "bfloat16", "auto"))
    assert caches["auto"].dtype == mx.float16 and caches["float32"].dtype == mx.float32
    for half in ("float16", "bfloat16", "auto"):
        assert caches[half].num_blocks == 2 * caches["float32"].num_blocks
        assert caches[half].bytes <= 1 << 20 and caches[half].bytes == caches["float32"].bytes


def greedy(model, cache: PagedKVCache, prompt: list[int], steps: int, chunk: int) -> tuple[np.ndarray, list[int]]:
    """First sampled position's logits (vocab,) and `steps` greedy tokens, prefilled in chunks of `chunk`."""
    table = tuple(range(-(-(len(prompt) + steps) // BLOCK)))
    logits, tokens, done = None, [], 0
    while done < len(prompt):
        piece = prompt[done : done + chunk]
        done += len(piece)
        hidden = ForwardInput(tuple(piece), (len(piece),), (done,), (table,), BLOCK).run(model, cache, "kernel")
        logits = model.compute_logits(hidden[-1:])[0]  # (vocab,)
        mx.eval(logits)
    first = np.array(logits)
    for _ in range(steps):
        tokens.append(int(mx.argmax(logits).item()))
        ctx = len(prompt) + len(tokens)
        hidden = ForwardInput((tokens[-1],), (1,), (ctx,), (table,), BLOCK).run(model, cache, "kernel")
        logits = model.compute_logits(hidden)[0]  # (vocab,)
        mx.eval(logits)
    return first, tokens


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_sixteen_bit_cache_matches_float32_on_the_default_model(dtype):
    from metrale.loading import load_model
    from metrale.models.cpu_quantized import set_activation_bits

    loaded = load_model(None, dtype=None)
    # int16 activations isolate the KV dtype's effect (the bounds were measured so): the default int12's
    # coarser rounding turns a tiny KV difference at a rounding edge into a larger logit one
    set_activation_bits(loaded.model, 16)
    mc = loaded.config
    shape = (mc.num_hidden_layers, 64, BLOCK, mc.num_key_value_heads, mc.head_dim)
    long_prompt = " ".join(PROMPTS * 12)  # ~400 tokens, prefilled in chunks of 96 over a cached prefix
    diffs, mismatches = [], []
    for text, chunk in [(p, 512) for p in PROMPTS] + [(long_prompt, 96)]:
        prompt = loaded.tokenizer.encode(text)
        base_logits, base = greedy(loaded.model, PagedKVCache(*shape, dtype=mx.float32), prompt, 16, chunk)
        half_logits, half = greedy(loaded.model, PagedKVCache(*shape, dtype=dtype), prompt, 16, chunk)
        diffs.append(float(np.abs(half_logits - base_logits).max()))
        if half != base:
            mismatches.append((text[:30], base, half))
    print(f"{dtype}: first-step logits max abs diff per prompt {diffs}")
    assert max(diffs) <= LOGITS_BOUND[dtype], diffs
    if dtype == mx.float16:  # the "auto" choice: the same greedy tokens on every prompt
        assert not mismatches, mismatches
