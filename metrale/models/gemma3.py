"""Gemma 3 text models for flat varlen batches over the paged cache.

What differs from llama (each matched against mlx-lm's gemma3_text):

    embeddings       scaled by sqrt(hidden_size), rounded to bfloat16 as mlx-lm and the bfloat16
                     checkpoints do (exact for hidden sizes whose root is a small integer)
    RMSNorm          x / rms(x) * (1 + w) everywhere: the layer norms, the final norm, q/k norms
    attention        q/k norm per head before RoPE; scale query_pre_attn_scalar ** -0.5;
                     layer_types alternate sliding (window `sliding_window`, RoPE base
                     rope_local_theta, unscaled) and global layers (rope_theta with rope_scaling)
    block            x + post_attn_norm(attn(in_norm(x))), then h + post_ff_norm(mlp(pre_ff_norm(h)))
    MLP              GeGLU with gelu_pytorch_tanh
    logits           tied embeddings by default; c * tanh(logits / c) when final_logit_softcapping is c
"""

from __future__ import annotations

from kernels.norm_rope import RMSNorm
from kernels.runtime import mx

from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache
from metrale.models.config import ModelConfig
from metrale.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_FLOAT16_MAX = float(mx.finfo(mx.float16).max)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + w) (fused on CPU: kernels/norm_rope.py)."""

    weight_offset = 1.0

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__(dims, eps=eps)
        self.weight = mx.zeros((dims,))


def residual_add(x: mx.array, y: mx.array) -> mx.array:
    """x + y; in float16 summed in float32 and clipped to float16's range (gemma's activations
    outgrow float16, as in mlx-lm)."""
    if x.dtype != mx.float16:
        return x + y
    total = x.astype(mx.float32) + y.astype(mx.float32)
    return mx.clip(total, -_FLOAT16_MAX, _FLOAT16_MAX).astype(mx.float16)


class Gemma3Attention(LlamaAttention):
    """Llama attention with (1 + w) q/k norms; window, RoPE base and scale per layer from the config."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, qk_norm=GemmaRMSNorm)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """Sandwich-norm block: each sublayer's output is normed before its residual add."""

    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer_index: int, attention_class: type[LlamaAttention]) -> None:
        super().__init__(config, layer_index, attention_class)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D) -> (T, D)."""
        r = self.self_attn(self.input_layernorm(x), positions, kv_cache, metadata)  # (T, D)
        h = residual_add(x, self.post_attention_layernorm(r))  # (T, D)
        r = self.mlp(self.pre_feedforward_layernorm(h))  # (T, D)
        return residual_add(h, self.post_feedforward_layernorm(r))  # (T, D)

    def residual_forward(
        self, x: mx.array, residual: mx.array | None, positions: mx.array, kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> tuple[mx.array, None]:
        """The sandwich block sums its own residuals (see LlamaDecoderLayer.residual_forward): (output, None)."""
        if residual is not None:
            x = residual_add(residual, x)
        return self(x, positions, kv_cache, metadata), None


class Gemma3Model(LlamaModel):
    """Scaled embeddings, sandwich-norm layers, (1 + w) final norm."""

    layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, attention_class: type[LlamaAttention] = Gemma3Attention) -> None:
        super().__init__(config, attention_class)
        self._embed_scale = float(mx.array(config.hidden_size**0.5, dtype=mx.bfloat16).item())

    def embed(self, token_ids: mx.array) -> mx.array:
        """token_ids (T,) -> embeddings scaled by sqrt(hidden_size) (T, D)."""
        h = self.embed_tokens(token_ids)  # (T, D)
        return h * mx.array(self._embed_scale, dtype=h.dtype)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """A gemma3 text causal LM for the runner (the contract of `LlamaForCausalLM`)."""

    model_class = Gemma3Model
    attention_class = Gemma3Attention

    def compute_logits(self, hidden: mx.array) -> mx.array:
        """hidden (N, D) -> float32 logits (N, vocab_size), soft-capped when the config says so."""
        logits = super().compute_logits(hidden)  # (N, vocab) float32
        cap = self.config.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap
