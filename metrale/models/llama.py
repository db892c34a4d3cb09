"""The llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral) for flat variable-length batches,
and the building blocks qwen2, qwen3 and gemma3 subclass.

One forward takes every scheduled token of every sequence at once (see docs/internals.md,
"the step's arrays"):

    token_ids  [a a a a a | b | c]   (T,)   positions [16..20 | 40 | 7]   (T,)

Every linear layer runs over all T tokens; RoPE uses each token's own position; each layer
writes its new K/V into the paged pool through `attn_metadata.slot_mapping` and attends over
each sequence's context through `kvcache.attention.paged_attention`. Parameter names follow
Hugging Face / mlx-lm (`model.layers.0.self_attn.q_proj.weight`), so their weights load as-is.
"""

from __future__ import annotations

from kernels.activations import gated_activation_fn
from kernels.norm_rope import RMSNorm
from kernels.runtime import mx, nn
from kvcache.attention import AttentionMetadata, paged_attention
from kvcache.storage import PagedKVCache
from metrale.models.config import ModelConfig
from metrale.models.rope import FlatRope


def _sum_across(x: mx.array, group: mx.distributed.Group | None) -> mx.array:
    """x summed over the ranks of `group` (a row-parallel layer's partial sums); x itself without one."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention of one layer over the paged cache.

    Subclasses pick the projection biases (`qkv_bias`, `out_bias`; default: the config's
    attention_bias) and a per-head norm of q and k before RoPE (`qk_norm`: a norm class built as
    `qk_norm(head_dim, eps=...)`, qwen3 and gemma3). The window, the RoPE base and the scale come
    from the config, per layer.

    Under tensor parallelism (metrale.distributed.sharding) a rank holds n_heads / N heads and
    n_kv_heads / N kv heads, and `tp_group` is set: o_proj's partial sums are added across the ranks."""

    tp_group: mx.distributed.Group | None = None

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        *,
        qkv_bias: bool | None = None,
        out_bias: bool | None = None,
        qk_norm: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.sliding_window = config.layer_sliding_window(layer_index)
        dim = config.hidden_size
        qkv_bias = config.attention_bias if qkv_bias is None else qkv_bias
        out_bias = config.attention_bias if out_bias is None else out_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=out_bias)
        self.use_qk_norm = qk_norm is not None
        if qk_norm is not None:
            self.q_norm = qk_norm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = qk_norm(self.head_dim, eps=config.rms_norm_eps)
        self._rope = FlatRope(config, local=config.is_sliding_layer(layer_index))
        self._temperature = (config.attn_temperature_scale, config.attn_temperature_length)

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D), positions (T,) -> (T, D); writes this layer's K/V for the T tokens."""
        num_tokens = x.shape[0]
        if "qkv_proj" in self:  # one fused call of the quantized CPU kernels (metrale.models.cpu_quantized)
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(num_tokens, self.n_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = k.reshape(num_tokens, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = v.reshape(num_tokens, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)  # each head normalized over head_dim
        q, k = self._rope.rotate_qk(q, k, positions, metadata)  # (T, n_heads | n_kv_heads, head_dim) each
        if self._temperature[0] is not None:
            q = q * self._query_temperature(positions, metadata).astype(q.dtype)
        # each pool (num_blocks, n_kv_heads, block_size, head_dim), already holding this step's K/V
        k_pool, v_pool = kv_cache.write(self.layer_index, k, v, metadata.slot_mapping)
        out = paged_attention(q, k_pool, v_pool, metadata, self.scale, sliding_window=self.sliding_window)
        # out (T, n_heads, head_dim)
        return _sum_across(self.o_proj(out.reshape(num_tokens, self.n_heads * self.head_dim)), self.tp_group)  # (T, D)


    def _query_temperature(self, positions: mx.array, metadata: AttentionMetadata) -> mx.array:
        """Ministral 3's per-position query scale 1 + beta * ln(1 + floor(p / length)), (T, 1, 1)."""
        beta, length = self._temperature

        def scale() -> mx.array:
            floors = mx.floor(positions.astype(mx.float32) / length)  # (T,)
            return (1 + beta * mx.log(1 + floors))[:, None, None]  # (T, 1, 1)

        return metadata.cached(("query_temperature", beta, length), scale)


class LlamaMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act from config.hidden_act (SwiGLU for silu,
    GeGLU for gemma's gelu_pytorch_tanh). Under tensor parallelism a rank holds intermediate / N
    features and `tp_group` is set: down_proj's partial sums are added across the ranks."""

    tp_group: mx.distributed.Group | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden_act = config.hidden_act
        dim, hidden, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        # fused act(gate) * up, decided once at load: one vectorized pass on CPU (MLX's exp is scalar there)
        self._gated_activation = gated_activation_fn(config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        """x (T, D) -> (T, D)."""
        if "gate_up_proj" in self:  # act(gate) * up in the matmul's epilogue (metrale.models.cpu_quantized)
            hidden = self.gate_up_proj(x)  # (T, intermediate)
        else:
            hidden = self._gated_activation(self.gate_proj(x), self.up_proj(x))  # (T, intermediate)
        return _sum_across(self.down_proj(hidden), self.tp_group)  # (T, D)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP. Subclasses may swap `norm_class`."""

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, layer_index: int, attention_class: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer_index)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D) -> (T, D)."""
        mlp_out, h = self.residual_forward(x, None, positions, kv_cache, metadata)
        return h + mlp_out  # (T, D)

    def residual_forward(
        self, x: mx.array, residual: mx.array | None, positions: mx.array, kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[mx.array, mx.array | None]:
        """The layer on the hidden states residual + x (residual None: x) -> (mlp_out, h), the layer's
        output being h + mlp_out, left unsummed: the next norm adds it in the same node (RMSNorm.add_and_norm),
        so a decode step has no separate residual Add. Each sum is the unfused layer's, bit for bit."""
        if residual is None:
            h, normed = x, self.input_layernorm(x)  # (T, D) each
        else:
            h, normed = self.input_layernorm.add_and_norm(x, residual)  # h = residual + x
        attn_out = self.self_attn(normed, positions, kv_cache, metadata)  # (T, D)
        h, normed = self.post_attention_layernorm.add_and_norm(attn_out, h)  # h + attn_out, its norm
        return self.mlp(normed), h  # (T, D) each


# Steps of this many tokens (prompt chunks, wide batches) evaluate their forward one layer at a time. Evaluated
# whole, MLX allocated the outputs of several layers ahead of freeing the ones behind: a 512-token chunk of the
# 1B shape peaked at 278 MiB of activations, 63 layer by layer (MLX's peak memory, benchmarks/step_profile.py's
# step; the 3B shape's server peaked ~0.4 GiB above idle on a 4096-token prompt). The ~16-28 extra
# synchronizations cost microseconds against a step of 0.5 s and more.
EVAL_EACH_LAYER_FROM_TOKENS = 64
# Smaller steps (decodes) hand each layer to MLX asynchronously as soon as it is built (mx.async_eval), so the
# kernels compute layer i while Python builds layer i + 1: building a step's graph takes ~1 ms of the 1B shape's
# ~24 ms step and ~2.2 of the default model's ~8.7 (30 layers, 434 nodes), which ran before any kernel did.
# Decode steps alternated in one process (2-core Zen 4): the default model 1.2-2.1 ms faster a step at 1, 8 and
# 32 sequences (15-20% at one), the 1B shape 0.1-1.0 ms. False (benchmarks that read the whole lazy graph,
# step_profile's node count): one evaluation of the whole step, as before.
OVERLAP_LAYERS = True


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm. Subclasses may swap `layer_class`,
    `norm_class` and `embed`."""

    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, attention_class: type[LlamaAttention] = LlamaAttention) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [self.layer_class(config, i, attention_class) for i in range(config.num_hidden_layers)]
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)

    def embed(self, token_ids: mx.array) -> mx.array:
        """token_ids (T,) -> input hidden states (T, D)."""
        return self.embed_tokens(token_ids)  # (T, D)

    def __call__(
        self, token_ids: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """token_ids (T,), positions (T,) -> normed hidden states (T, D)."""
        x, residual = self.embed(token_ids), None  # the hidden states are residual + x, (T, D) each
        if token_ids.size >= EVAL_EACH_LAYER_FROM_TOKENS:
            evaluate = mx.eval  # bounds a wide step's activations
        elif OVERLAP_LAYERS:
            evaluate = mx.async_eval  # the kernels run this layer while Python builds the next
        else:
            evaluate = None  # one evaluation of the whole step, by the caller
        for layer in self.layers:
            x, residual = layer.residual_forward(x, residual, positions, kv_cache, metadata)
            if evaluate is not None:  # (the layer's K/V writes are inputs of x: they run too)
                evaluate(*(a for a in (x, residual) if a is not None))
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[1]  # (T, D)


class LlamaForCausalLM(nn.Module):
    """A llama-family causal LM for the runner: `__call__` for all tokens, `compute_logits` for the
    sampled rows only.

    `kv_cache` is a `kvcache.storage.PagedKVCache`: its `write(layer, k, v, slot_mapping)` returns
    the layer's updated (k_pool, v_pool), which attention then reads; `attn_metadata` is the step's
    `kvcache.attention.AttentionMetadata`, built once and shared by every layer.

    Other families subclass it and swap `model_class` and `attention_class` (qwen2, qwen3, gemma3).
    """

    model_class: type[LlamaModel] = LlamaModel
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, self.attention_class)
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
