"""Swap a loaded model's quantized layers for the CPU kernels' modules (kernels/qmm.py).

The loader calls `use_cpu_kernels(model)` on CPU when quantized weights stay quantized. Per decoder
layer, layers that read the same input become one call:

    self_attn.q_proj, k_proj, v_proj   -> self_attn.qkv_proj     one matmul, three outputs (q, k, v)
    mlp.gate_proj, up_proj             -> mlp.gate_up_proj       act(gate) * up in the kernel's epilogue
    self_attn.o_proj, mlp.down_proj, lm_head                     one QuantizedLinearCPU each
    mlp.switch_mlp (MoE experts)       -> QuantizedSwitchGLUCPU  gathered matmuls per (token, expert) row,
                                                                 gate/up fused (kernels/moe.py); the router
                                                                 mlp.gate one QuantizedLinearCPU
    model.embed_tokens                 -> QuantizedEmbeddingCPU  lookups dequantize their rows; the
                                                                 tied lm_head runs the matmul kernel

Fusion needs the same bits and group size (else the layers are swapped one by one) and, for gate/up,
an activation the epilogue has (silu, gelu_pytorch_tanh) and no biases. Layers in a format the
kernels do not compute stay as they are (the loader dequantizes those on CPU). The LlamaAttention and
LlamaMLP forwards check for qkv_proj / gate_up_proj.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.moe import QuantizedSwitchGLUCPU, has_moe_kernels
from kernels.qmm import GLU_KINDS, QuantizedEmbeddingCPU, QuantizedLinearCPU, supports
from kernels.runtime import nn

__all__ = ["set_activation_bits", "use_cpu_kernels"]


def _kernel_ready(layers: Sequence[nn.Module]) -> bool:
    """True when every layer is an nn.QuantizedLinear the kernels compute, all in one format."""
    if not all(isinstance(layer, nn.QuantizedLinear) and getattr(layer, "mode", "affine") == "affine"
               and supports(layer.bits, layer.group_size) for layer in layers):
        return False
    return len({(layer.bits, layer.group_size) for layer in layers}) == 1


def _swap_each(parent: nn.Module, names: Sequence[str]) -> int:
    count = 0
    for name in names:
        if _kernel_ready([parent[name]]):
            setattr(parent, name, QuantizedLinearCPU.from_layers([parent[name]]))
            count += 1
    return count


def _fuse(parent: nn.Module, names: Sequence[str], fused_name: str, glu: str | None = None) -> int:
    """Replace parent.<names> by one fused module parent.<fused_name>; else swap them one by one."""
    layers = [parent[name] for name in names]
    has_bias = any("bias" in layer for layer in layers)
    if _kernel_ready(layers) and not (glu is not None and (glu not in GLU_KINDS or has_bias)):
        setattr(parent, fused_name, QuantizedLinearCPU.from_layers(layers, glu=glu))
        for name in names:
            delattr(parent, name)
        return len(names)
    return _swap_each(parent, names)


def _swap_experts(mlp: nn.Module) -> int:
    """An MoE block's quantized experts -> one QuantizedSwitchGLUCPU (when the kernels compute their
    format), and its router; returns how many modules were replaced."""
    experts = mlp.switch_mlp
    layers = [experts.gate_proj, experts.up_proj, experts.down_proj]
    count = _swap_each(mlp, ("gate",))
    formats = {(getattr(layer, "bits", None), getattr(layer, "group_size", None)) for layer in layers}
    if (has_moe_kernels() and len(formats) == 1 and all(hasattr(layer, "scales") for layer in layers)
            and supports(*formats.pop()) and experts.hidden_act in GLU_KINDS):
        mlp.switch_mlp = QuantizedSwitchGLUCPU(*layers, hidden_act=experts.hidden_act)
        count += 3
    return count


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap the quantized layers of a llama-family model (LlamaForCausalLM and its subclasses) in
    place; returns how many nn.QuantizedLinear / nn.QuantizedEmbedding were replaced."""
    count = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        count += _fuse(attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        count += _swap_each(attn, ("o_proj",))
        if "switch_mlp" in mlp:
            count += _swap_experts(mlp)
            continue
        count += _fuse(mlp, ("gate_proj", "up_proj"), "gate_up_proj", glu=mlp.hidden_act)
        count += _swap_each(mlp, ("down_proj",))
    embed = model.model.embed_tokens
    if isinstance(embed, nn.QuantizedEmbedding) and supports(embed.bits, embed.group_size) \
            and getattr(embed, "mode", "affine") == "affine":
        model.model.embed_tokens = QuantizedEmbeddingCPU(embed)
        count += 1
    if "lm_head" in model:
        count += _swap_each(model, ("lm_head",))
    return count


def set_activation_bits(model: nn.Module, bits: int) -> int:
    """Make every kernel module of `model` quantize its activations to int`bits` (8, 12 or 16; 0: auto, int8
    for calls of kernels.backend.INT8_MIN_TOKENS token rows or more; the default comes from
    METRALE_QMM_ACTIVATIONS at load). Returns how many modules changed."""
    if bits not in (0, 8, 12, 16):
        raise ValueError(f"activation bits must be 8, 12, 16 or 0 (auto), got {bits}")
    kinds = (QuantizedLinearCPU, QuantizedEmbeddingCPU, QuantizedSwitchGLUCPU)
    modules = [m for m in model.modules() if isinstance(m, kinds)]
    for module in modules:
        module.activation_bits = bits
    return len(modules)
