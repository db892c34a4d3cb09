"""Gemma 2: gemma3's block (sandwich norms, (1 + w) RMSNorm, GeGLU, scaled embeddings) without q/k
norms and with soft-capped attention scores.

What differs from gemma3 (each matched against mlx-lm's gemma2):

    attention        scores = c * tanh(scores / c) before the mask and softmax (attn_logit_softcapping c);
                     every other layer slides (even layers, window `sliding_window`), one RoPE base
    embeddings       scaled by sqrt(hidden_size) in the activations' dtype (no bfloat16 rounding)
    logits           final_logit_softcapping as gemma3

The capped scores need the scores themselves, so attention runs as explicit matmuls over the
gathered context (the metadata's gather indices and masks, shared with kvcache.attention), not
through sdpa or the fused decode kernel.
"""

from __future__ import annotations

from kernels.runtime import mx

from kvcache.attention import AttentionMetadata, DecodeRun, flat_rows, gathered_values
from kvcache.storage import PagedKVCache
from metrale.models.config import ModelConfig
from metrale.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
from metrale.models.llama import LlamaAttention, _sum_across


def _capped_attention(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None, scale: float,
                      cap: float) -> mx.array:
    """q (N, n_kv, rows, hd), keys / values (N, n_kv, L, hd), mask broadcast to (N, n_kv, rows, L) bool
    or None -> (N, n_kv, rows, hd) float32."""
    scores = (q.astype(mx.float32) * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)  # (N, n_kv, rows, L)
    scores = mx.tanh(scores / cap) * cap
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=mx.float32))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return probs @ values.astype(mx.float32)  # (N, n_kv, rows, hd)


def softcapped_paged_attention(queries: mx.array, k_pool: mx.array, v_pool: mx.array, md: AttentionMetadata,
                               scale: float, cap: float, window: int | None) -> mx.array:
    """paged_attention's contract (queries (T, n_heads, hd) -> (T, n_heads, hd)) with soft-capped scores."""
    num_tokens, n_heads, head_dim = queries.shape
    n_kv = k_pool.shape[1]
    rep = n_heads // n_kv
    flat_k = flat_rows(k_pool)  # (num_blocks * n_kv * block_size, row_width): int8 pools are q8 rows
    flat_v = flat_rows(v_pool)

    def gather(flat: mx.array, rows: mx.array) -> mx.array:  # (..., L, hd) float32
        return gathered_values(flat[rows], head_dim, mx.float32)

    decode_out = None
    if md.num_decode:
        rows, mask = md.cached(("decode", window, n_kv), lambda: md.decode_gather(window, n_kv))  # (B, n_kv, L)
        if md.decode_slice is not None:
            decode_q = queries[md.decode_slice[0] : md.decode_slice[1]]  # (B, n_heads, hd)
        else:
            decode_q = queries[md.decode_rows]
        q = decode_q.reshape(-1, n_kv, rep, head_dim)  # (B, n_kv, rep, hd)
        decode_out = _capped_attention(q, gather(flat_k, rows), gather(flat_v, rows), mask, scale, cap).reshape(-1, n_heads, head_dim)
    pieces = []
    for piece in md.output_order:
        if isinstance(piece, DecodeRun):
            pieces.append(decode_out[piece.start : piece.end])
            continue
        rows, start = md.cached(("chunk", piece.index, window, n_kv), lambda p=piece: md.chunk_gather(p, window, n_kv))
        mask = md.cached(("chunk_mask", piece.index, window), lambda p=piece, s=start: md.chunk_mask(p, window, s))
        chunk_q = queries[piece.row_start : piece.row_start + piece.query_len]  # (q_len, n_heads, hd)
        q = chunk_q.reshape(piece.query_len, n_kv, rep, head_dim).transpose(1, 2, 0, 3)  # (n_kv, rep, q_len, hd)
        q = q.reshape(1, n_kv, rep * piece.query_len, head_dim)
        mask = mx.tile(mask, (rep, 1))  # (rep * q_len, L)
        out = _capped_attention(q, gather(flat_k, rows), gather(flat_v, rows), mask, scale, cap)  # (1, n_kv, rep * q_len, hd)
        out = out.reshape(n_kv, rep, piece.query_len, head_dim).transpose(2, 0, 1, 3)  # (q_len, n_kv, rep, hd)
        pieces.append(out.reshape(piece.query_len, n_heads, head_dim))
    out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)  # (T, n_heads, hd)
    return out.astype(queries.dtype)


class Gemma2Attention(LlamaAttention):
    """Llama attention whose scores are soft-capped (config.attn_logit_softcapping; plain without one)."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index)
        self.softcap = config.attn_logit_softcapping

    def __call__(
        self, x: mx.array, positions: mx.array, kv_cache: PagedKVCache, metadata: AttentionMetadata
    ) -> mx.array:
        """x (T, D), positions (T,) -> (T, D); writes this layer's K/V for the T tokens."""
        if self.softcap is None:
            return super().__call__(x, positions, kv_cache, metadata)
        num_tokens = x.shape[0]
        if "qkv_proj" in self:
            q, k, v = self.qkv_proj(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(num_tokens, self.n_heads, self.head_dim)  # (T, n_heads, head_dim)
        k = k.reshape(num_tokens, self.n_kv_heads, self.head_dim)  # (T, n_kv_heads, head_dim)
        v = v.reshape(num_tokens, self.n_kv_heads, self.head_dim)
        q, k = self._rope.rotate_qk(q, k, positions, metadata)
        k_pool, v_pool = kv_cache.write(self.layer_index, k, v, metadata.slot_mapping)
        out = softcapped_paged_attention(q, k_pool, v_pool, metadata, self.scale, self.softcap, self.sliding_window)
        return _sum_across(self.o_proj(out.reshape(num_tokens, self.n_heads * self.head_dim)), self.tp_group)


class Gemma2Model(Gemma3Model):
    """gemma3's model with embeddings scaled by sqrt(hidden_size) unrounded."""

    def __init__(self, config: ModelConfig, attention_class: type[LlamaAttention] = Gemma2Attention) -> None:
        super().__init__(config, attention_class)
        self._embed_scale = config.hidden_size**0.5


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """A gemma2 causal LM for the runner (the contract of `LlamaForCausalLM`)."""

    model_class = Gemma2Model
    attention_class = Gemma2Attention
