"""Mixture-of-experts models: Qwen3-MoE and Mixtral, the llama architecture with a routed MLP.

Per layer the MLP is a sparse block (mlx-lm's parameter names, so MLX folders load as-is):

    mlp.gate                  router nn.Linear (D -> E)
    mlp.switch_mlp.gate_proj  experts (E, I, D); up_proj (E, I, D); down_proj (E, D, I)

Every token of the step is routed at once: softmax of the router logits (float32), the top-k
experts, their probabilities renormalized to sum to 1 when `norm_topk_prob` (Mixtral always; Qwen3
as config.json says), then y = sum_j p_j * down_j(act(gate_j(x)) * up_j(x)). The experts of all
tokens run as gathered matmuls: mx.gather_mm / mx.gather_qmm (the plain-MLX path, every backend),
or on CPU with quantized experts metrale's kernels (kernels/moe.py, swapped in by
metrale.models.cpu_quantized).

Hugging Face checkpoints hold one tensor per expert (`mlp.experts.3.up_proj`, Mixtral's
`block_sparse_moe.experts.3.w3`); the folder loader stacks them (metrale.loading.experts).
"""

from __future__ import annotations

import math

from kernels.activations import gated_activation_fn
from kernels.runtime import mx, nn

from metrale.models.config import ModelConfig
from metrale.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from metrale.models.qwen3 import Qwen3Attention

_SORT_FROM_ROWS = 64  # from this many (token, expert) rows the plain path sorts them by expert first


class SwitchLinear(nn.Module):
    """E float linear maps without bias: weight (E, out, in); row (t, j) uses expert indices[t, j]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int) -> None:
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., 1, in) broadcast against indices (...) -> (..., 1, out)."""
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> "QuantizedSwitchLinear":
        """The same experts affine-quantized (what nn.quantize calls)."""
        return QuantizedSwitchLinear(self.weight, group_size=group_size, bits=bits, mode=mode)


class QuantizedSwitchLinear(nn.Module):
    """SwitchLinear with affine-quantized experts: weight (E, out, in * bits / 32) uint32, scales and
    biases (E, out, in / group_size)."""

    def __init__(self, weight: mx.array, *, group_size: int, bits: int, mode: str = "affine") -> None:
        super().__init__()
        if mode != "affine":
            raise ValueError(f"quantization mode {mode!r} is not supported for experts; supported: affine")
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, self.biases = mx.quantize(weight, group_size, bits)
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x (..., 1, in) broadcast against indices (...) -> (..., 1, out)."""
        return mx.gather_qmm(x, self["weight"], self["scales"], self["biases"], rhs_indices=indices, transpose=True,
                             group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)


class SwitchGLU(nn.Module):
    """The experts of one MoE block: down(act(gate(x)) * up(x)) for each (token, chosen expert)."""

    def __init__(self, dims: int, hidden: int, num_experts: int, hidden_act: str) -> None:
        super().__init__()
        self.hidden_act = hidden_act
        self.gate_proj = SwitchLinear(dims, hidden, num_experts)
        self.up_proj = SwitchLinear(dims, hidden, num_experts)
        self.down_proj = SwitchLinear(hidden, dims, num_experts)
        self._gated_activation = gated_activation_fn(hidden_act)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x (T, D), indices (T, top_k) -> (T, top_k, D)."""
        rows = mx.expand_dims(x, (-2, -3))  # (T, 1, 1, D)
        top_k = indices.shape[-1]
        order = None
        if indices.size >= _SORT_FROM_ROWS:  # contiguous runs per expert for gather_mm / gather_qmm
            flat = indices.flatten()  # (T * top_k,)
            order = mx.argsort(flat)  # (T * top_k,)
            rows = rows.flatten(0, -3)[order // top_k]  # (T * top_k, 1, D)
            indices = flat[order]  # (T * top_k,)
        sorted_indices = order is not None
        hidden = self._gated_activation(self.gate_proj(rows, indices, sorted_indices),
                                        self.up_proj(rows, indices, sorted_indices))
        out = self.down_proj(hidden, indices, sorted_indices)  # (T, top_k, 1, D) or (T * top_k, 1, D)
        if order is not None:
            out = out[mx.argsort(order)].reshape(-1, top_k, 1, out.shape[-1])  # back to (T, top_k, 1, D)
        return out.squeeze(-2)  # (T, top_k, D)


def route(logits: mx.array, top_k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Router logits (T, E) -> (indices (T, top_k) int, weights (T, top_k) float32): the top_k experts
    by softmax probability, renormalized to sum to 1 when `normalize`."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)  # (T, E)
    indices = mx.argpartition(probs, kth=-top_k, axis=-1)[..., -top_k:]  # (T, top_k)
    weights = mx.take_along_axis(probs, indices, axis=-1)  # (T, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights


class SparseMoeBlock(nn.Module):
    """Router + experts: x (T, D) -> sum over the top-k experts of weight * expert(x) (T, D)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                    config.hidden_act)

    def __call__(self, x: mx.array) -> mx.array:
        """x (T, D) -> (T, D)."""
        indices, weights = route(self.gate(x), self.top_k, self.norm_topk_prob)  # (T, top_k) each
        y = self.switch_mlp(x, indices)  # (T, top_k, D)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)  # (T, D)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A llama block whose MLP is the sparse MoE block."""

    def __init__(self, config: ModelConfig, layer_index: int, attention_class: type[LlamaAttention]) -> None:
        super().__init__(config, layer_index, attention_class)
        self.mlp = SparseMoeBlock(config)


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (qwen3_moe): Qwen3 attention (per-head q/k RMSNorm) and routed experts."""

    model_class = MoeModel
    attention_class = Qwen3Attention


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: llama attention and routed experts (top-2 of 8, renormalized)."""

    model_class = MoeModel
