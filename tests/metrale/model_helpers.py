"""Test helpers for the models: tiny random llama configs, a twin mlx-lm reference with the same
weights, and a minimal paged "runner" that drives a model through the real kvcache modules."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama as mlx_llama  # noqa: E402
from mlx_lm.models.base import create_causal_mask  # noqa: E402

from kvcache.attention import AttentionMetadata  # noqa: E402
from kvcache.storage import PagedKVCache  # noqa: E402
from metrale.models.config import ModelConfig  # noqa: E402
from metrale.models.llama import LlamaForCausalLM  # noqa: E402

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 101,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 256,
}


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """A config.json-style dict of a tiny llama; keyword arguments override entries."""
    return {**TINY_LLAMA, **overrides}


def make_twins(config_dict: Mapping[str, Any], seed: int = 0) -> tuple[Any, LlamaForCausalLM]:
    """(mlx-lm llama Model, metrale LlamaForCausalLM) holding the same random float32 weights.

    Weights are scaled up from mlx's defaults so that logits differ clearly between tokens."""
    mx.random.seed(seed)
    args = mlx_llama.ModelArgs.from_dict(dict(config_dict))
    reference = mlx_llama.Model(args)
    params = [
        (name, value * 2.0 if value.ndim == 2 else value + 0.1 * mx.random.normal(value.shape))  # matrices, norms
        for name, value in tree_flatten(reference.parameters())
    ]
    reference.load_weights(params)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(config_dict))
    model.load_weights(params, strict=True)
    mx.eval(reference.parameters(), model.parameters())
    return reference, model


def reference_logits(reference: Any, token_ids: Sequence[int], sliding_window: int | None = None) -> mx.array:
    """mlx-lm's logits (L, vocab) for one whole sequence, no cache.

    With a sliding window every layer gets mlx-lm's own windowed causal mask (its llama Model
    wants at least one full-attention layer, so the layers are driven directly)."""
    inputs = mx.array([list(token_ids)])  # (1, L)
    if sliding_window is None:
        return reference(inputs)[0]  # (L, vocab)
    h = reference.model.embed_tokens(inputs)  # (1, L, D)
    mask = create_causal_mask(len(token_ids), window_size=sliding_window)  # (L, L) bool
    for layer in reference.model.layers:
        h = layer(h, mask)  # (1, L, D)
    h = reference.model.norm(h)
    return reference.model.embed_tokens.as_linear(h)[0]  # (L, vocab)


class PagedHarness:
    """Drives a model over a real PagedKVCache as the runner will: per step, a flat batch of
    (sequence, new tokens) chunks, block tables from a shuffled free list (non-contiguous on
    purpose), metadata built once, logits for every row."""

    def __init__(self, config: ModelConfig, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.block_size = block_size
        self.cache = PagedKVCache(
            config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def _table_for(self, seq: str, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < num_tokens:
            if not self.free_blocks:
                raise RuntimeError(f"harness pool exhausted at {num_tokens} tokens for {seq}")
            table.append(self.free_blocks.pop())
        return table

    def build(self, chunks: Sequence[tuple[str, Sequence[int]]]) -> tuple[mx.array, AttentionMetadata]:
        """Token ids (T,) and metadata for one step; advances each sequence's cached count."""
        query_lens, context_lens, tables, flat = [], [], [], []
        for seq, tokens in chunks:
            start = self.num_cached.get(seq, 0)
            context = start + len(tokens)
            query_lens.append(len(tokens))
            context_lens.append(context)
            tables.append(self._table_for(seq, context))
            flat.extend(tokens)
            self.num_cached[seq] = context
        metadata = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size)
        return mx.array(flat, dtype=mx.int32), metadata

    def step(self, model: Any, chunks: Sequence[tuple[str, Sequence[int]]]) -> list[mx.array]:
        """Run one flat forward; returns each chunk's logits (len(tokens), vocab), in order."""
        token_ids, metadata = self.build(chunks)
        hidden = model(token_ids, metadata.positions, self.cache, metadata)  # (T, D)
        logits = model.compute_logits(hidden)  # (T, vocab)
        mx.eval(logits)  # also materializes every layer's pool write, as the runner's per-step eval does
        out, row = [], 0
        for _, tokens in chunks:
            out.append(logits[row : row + len(tokens)])
            row += len(tokens)
        return out

    def greedy(self, model: Any, prompts: Sequence[Sequence[int]],
               steps: int) -> tuple[list[mx.array], list[list[int]]]:
        """All prompts in one varlen step, then one decode step for all of them per token: ([the prompt step's
        last logits (vocab,) per prompt], [`steps` greedy tokens per prompt])."""
        logits = self.step(model, [(f"s{i}", p) for i, p in enumerate(prompts)])
        firsts = [chunk[-1] for chunk in logits]
        outs: list[list[int]] = [[] for _ in prompts]
        for step in range(steps):
            tokens = [int(mx.argmax(chunk[-1]).item()) for chunk in logits]
            for out, token in zip(outs, tokens):
                out.append(token)
            if step + 1 < steps:
                logits = self.step(model, [(f"s{i}", [t]) for i, t in enumerate(tokens)])
        return firsts, outs


CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def tiny_vocab(size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a tiny byte-level BPE vocab: 3 control tokens, single characters, merges."""
    singles = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?") + ["Ġ", "Ċ"]
    tokens, merges = list(CONTROL_TOKENS) + singles, []
    pairs = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"] + [("h", "e"), ("l", "l"), ("o", "r"), ("Ġw", "or")]
    for left, right in pairs:
        if len(tokens) < size:
            tokens.append(left + right)
            merges.append(f"{left} {right}")
    tokens += [f"x{i}" for i in range(size - len(tokens))]  # unreachable fillers (no merge makes them)
    return tokens, merges


def byte_vocab(size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE vocab that can spell any text: 3 control tokens, the 256
    byte-level characters, a few merges, unreachable fillers up to `size` (>= 259)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for byte in range(256):  # GPT-2's bytes_to_unicode
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    tokens, merges = list(CONTROL_TOKENS) + chars, []
    for left, right in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ('"', ":"), ("Ġ", '"')]:
        if len(tokens) < size:
            tokens.append(left + right)
            merges.append(f"{left} {right}")
    tokens += [f"x{i}" for i in range(size - len(tokens))]
    return tokens, merges


def write_tiny_gguf(path: str, config_dict: Mapping[str, Any], params: Sequence[tuple[str, mx.array]], *,
                    vocab: tuple[list[str], list[str]] | None = None, chat_template: str = CHATML_TEMPLATE,
                    file_type: int | None = None) -> None:
    """Write HF-named weights as a llama GGUF the way llama.cpp's converter would: GGUF tensor
    names, Q/K rows permuted for interleaved RoPE, llama.* and tokenizer.* metadata.
    `vocab` (tokens, merges) replaces the default tiny_vocab; `chat_template` the ChatML one;
    general.file_type when given (15 with float16 tensors: what mx.load makes of a Q4_K_M file)."""
    from metrale.loading.gguf import permute_rope_rows

    heads = config_dict["num_attention_heads"]
    kv_heads = config_dict.get("num_key_value_heads") or heads
    arrays = {}
    for name, value in params:
        module, part = name.rsplit(".", 1)
        if module.startswith("model.layers."):
            _, _, layer, rest = module.split(".", 3)
            gguf = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
        else:
            gguf = _HF_TO_GGUF[module]
        if gguf.endswith("attn_q"):
            value = permute_rope_rows(value, heads)
        elif gguf.endswith("attn_k"):
            value = permute_rope_rows(value, kv_heads)
        arrays[f"{gguf}.{part}"] = value
    tokens, merges = vocab if vocab is not None else tiny_vocab(config_dict["vocab_size"])
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config_dict["hidden_size"]),
        "llama.block_count": u32(config_dict["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config_dict["intermediate_size"]),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv_heads),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config_dict["rms_norm_eps"], dtype=mx.float32),
        "llama.rope.freq_base": mx.array(config_dict["rope_theta"], dtype=mx.float32),
        "llama.context_length": u32(config_dict["max_position_embeddings"]),
        "llama.vocab_size": u32(config_dict["vocab_size"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in CONTROL_TOKENS else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.chat_template": chat_template,
    }
    if file_type is not None:
        metadata["general.file_type"] = u32(file_type)
    mx.save_gguf(path, arrays, metadata)


def write_tiny_model(path: str, seed: int = 0, **overrides: Any) -> str:
    """A tiny random llama GGUF (chatml template, 101-token byte-level vocab) at `path`, for engine
    tests that need a real model but not a real model's cost."""
    config_dict = tiny_config_dict(**overrides)
    _, model = make_twins(config_dict, seed=seed)
    write_tiny_gguf(path, config_dict, tree_flatten(model.parameters()))
    return path
