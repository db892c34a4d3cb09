"""The llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) for flat variable-length batches.

One forward takes every scheduled token of every sequence at once (see docs/internals.md,
"the step's arrays"):

    token_ids  [a a a a a | b | c]   (T,)   positions [16..20 | 40 | 7]   (T,)

Every linear layer runs over all T tokens; RoPE uses each token's own position; each layer
writes its new K/V into the paged pool through `attn_metadata.slot_mapping` and attends over
each sequence's context through `kvcache.attention.paged_attention`. Parameter names follow
Hugging Face / mlx-lm (`model.layers.0.self_attn.q_proj.weight`), so their weights load as-is.
"""

from __future__ import annotations

from kvcache.blas import preload_openblas

preload_openblas()  # before mlx.core is imported: fast float32 BLAS on Linux CPU

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from kvcache.attention import AttentionMetadata, paged_attention  # noqa: E402
from kvcache.storage import PagedKVCache  # noqa: E402
from metrale.models.config import ModelConfig  # noqa: E402
from metrale.models.rope import FlatRope  # noqa: E402


class LlamaAttention(nn.Module):
    """Grouped-query self-attention of one layer over the paged cache."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        dim, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self._rope = FlatRope(config)

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D), positions (T,) -> (T, D); writes this layer's K/V for the T tokens."""
        num_tokens = x.shape[0]
        q = self.q_proj(x).reshape(num_tokens, self.n_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = self.k_proj(x).reshape(num_tokens, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        q = self._rope(q, positions)  # (T, n_heads, head_dim)
        k = self._rope(k, positions)  # (T, n_kv_heads, head_dim)
        # each pool (num_slots, n_kv_heads, head_dim), already holding this step's K/V
        k_pool, v_pool = kv_cache.write(self.layer_index, k, v, metadata.slot_mapping)
        out = paged_attention(q, k_pool, v_pool, metadata, self.scale, sliding_window=self.sliding_window)
        # out (T, n_heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, self.n_heads * self.head_dim))  # (T, D)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        """x (T, D) -> (T, D)."""
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))  # (T, D)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D) -> (T, D)."""
        h = x + self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)  # (T, D)
        return h + self.mlp(self.post_attention_layernorm(h))  # (T, D)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self, token_ids: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """token_ids (T,), positions (T,) -> normed hidden states (T, D)."""
        h = self.embed_tokens(token_ids)  # (T, D)
        for layer in self.layers:
            h = layer(h, positions, kv_cache, metadata)  # (T, D)
        return self.norm(h)  # (T, D)


class LlamaForCausalLM(nn.Module):
    """A llama-family causal LM for the runner: `__call__` for all tokens, `compute_logits` for the
    sampled rows only.

    `kv_cache` is a `kvcache.storage.PagedKVCache`: its `write(layer, k, v, slot_mapping)` returns
    the layer's updated (k_pool, v_pool), which attention then reads; `attn_metadata` is the step's
    `kvcache.attention.AttentionMetadata`, built once and shared by every layer.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def __call__(
        self, token_ids: mx.array, positions: mx.array, kv_cache: PagedKVCache, attn_metadata: AttentionMetadata
    ) -> mx.array:
        """token_ids (T,) int32, positions (T,) int32 -> final normed hidden states (T, D).

        Writes the K/V of all T tokens into `kv_cache` at `attn_metadata.slot_mapping`.
        """
        return self.model(token_ids, positions, kv_cache, attn_metadata)

    def compute_logits(self, hidden: mx.array) -> mx.array:
        """hidden (N, D), the rows that sample -> float32 logits (N, vocab_size)."""
        if self.config.tie_word_embeddings:
            logits = self.model.embed_tokens.as_linear(hidden)  # (N, vocab)
        else:
            logits = self.lm_head(hidden)  # (N, vocab)
        return logits.astype(mx.float32)
