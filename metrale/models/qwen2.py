"""Qwen2 / Qwen2.5: the llama architecture with biased q/k/v projections and an unbiased output
projection (Hugging Face's Qwen2Attention hard-codes both; config.json has no attention_bias)."""

from __future__ import annotations

from metrale.models.config import ModelConfig
from metrale.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """Llama attention with q/k/v biases and no output bias."""

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, qkv_bias=True, out_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """A Qwen2 causal LM for the runner (the contract of `LlamaForCausalLM`)."""

    attention_class = Qwen2Attention
