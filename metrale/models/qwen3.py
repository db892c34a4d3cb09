"""Qwen3 (dense): the llama architecture with an RMSNorm over each head of q and k before RoPE
(`self_attn.q_norm` / `self_attn.k_norm`, weights of shape (head_dim,)), and explicit head_dim."""

from __future__ import annotations

from kernels.norm_rope import RMSNorm

from metrale.models.config import ModelConfig
from metrale.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head q/k RMSNorm; biases as config.attention_bias says."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, qk_norm=RMSNorm)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 causal LM for the runner (the contract of `LlamaForCausalLM`)."""

    attention_class = Qwen3Attention
