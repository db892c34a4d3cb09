"""Keep one rank's share of a loaded llama-family model (Megatron-style tensor parallelism).

Per decoder layer, with N ranks and this rank r:

    self_attn.q_proj, k_proj, v_proj   rows (output features) split: rank r holds heads
                                       [r*H/N, (r+1)*H/N) and kv heads [r*KV/N, (r+1)*KV/N)
    mlp.gate_proj, up_proj             rows split: intermediate features [r*I/N, (r+1)*I/N)
    self_attn.o_proj, mlp.down_proj    columns (input features) split; each rank's partial sums are
                                       added across the group (one all_sum each, in the model's forward)
    embed_tokens, lm_head, norms       kept whole on every rank

Mixture-of-experts layers (qwen3_moe, Mixtral: mlp.gate and mlp.switch_mlp's stacked experts) are refused with
a ValueError naming them, as is any layer that lacks one of the tensors above.

So each rank computes attention for its own heads and caches only its own kv heads (its paged pool
is 1/N of the unsharded one, with the same block tables), and a layer costs two all_sums.

It runs on the MLX modules the loader builds (nn.Linear, nn.QuantizedLinear), right after their
weights are loaded and before the CPU kernels' swap (metrale.models.cpu_quantized), which then
packs and fuses each rank's share like any smaller model. A quantized o_proj / down_proj is split
along its packed columns, so each share must hold whole quantization groups.
"""

from __future__ import annotations

import math

from kernels.runtime import mx, nn
from metrale.models.config import ModelConfig

__all__ = ["check_tensor_parallel", "shard_model"]

_ROW_SPLIT = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
              ("mlp", "gate_proj"), ("mlp", "up_proj"))
_COLUMN_SPLIT = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """ValueError naming the numbers unless `size` ranks split the model's heads, kv heads and MLP
    width evenly; a mixture-of-experts model is refused."""
    if size == 1:
        return
    if config.num_experts:
        raise ValueError(
            f"tensor parallelism of mixture-of-experts models is not supported: model.layers.0.mlp is a routed "
            f"block of {config.num_experts} experts (mlp.gate, mlp.switch_mlp.gate_proj / up_proj / down_proj of "
            f"shape (experts, out, in)), which this sharding does not split; run {config.architecture} with "
            f"tensor_parallel_size 1")
    parts = {"attention heads": config.num_attention_heads, "key/value heads": config.num_key_value_heads,
             "MLP features (intermediate_size)": config.intermediate_size}
    uneven = [f"{count} {what}" for what, count in parts.items() if count % size]
    if uneven:
        common = math.gcd(*parts.values())
        sizes = [n for n in range(2, common + 1) if common % n == 0]
        hint = f"sizes that fit: {', '.join(map(str, sizes))}" if sizes else "no size above 1 fits"
        raise ValueError(
            f"tensor parallel size {size} does not divide this model's {' and '.join(uneven)}: every rank must "
            f"hold the same number of heads and MLP features ({hint})")


def shard_model(model: nn.Module, group: mx.distributed.Group) -> None:
    """Keep rank `group.rank()`'s share of every decoder layer of `model` (a LlamaForCausalLM or a
    subclass) in place, and make its o_proj / down_proj outputs summed across `group`."""
    size, rank = group.size(), group.rank()
    check_tensor_parallel(model.config, size)
    for index, layer in enumerate(model.model.layers):
        for block, name in _ROW_SPLIT:
            _split(_child(layer, index, block, name), name, axis=0, size=size, rank=rank)
        for block, name in _COLUMN_SPLIT:
            _split(_child(layer, index, block, name), name, axis=1, size=size, rank=rank, where=f"layer {index}")
        attention = layer.self_attn
        attention.n_heads //= size
        attention.n_kv_heads //= size
        attention.tp_group = group
        layer.mlp.tp_group = group
    mx.eval(model.parameters())  # the full copies are freed here


def _child(layer: nn.Module, index: int, block: str, name: str) -> nn.Module:
    """layer.<block>, the module holding <name>; a ValueError naming the tensor when the layout lacks it."""
    parent = layer.get(block) if isinstance(layer.get(block), nn.Module) else None
    if parent is None or name not in parent:
        held = ", ".join(sorted(parent.children())) if parent is not None else "nothing"
        raise ValueError(f"tensor parallelism cannot shard model.layers.{index}.{block}.{name}: the layer has no "
                         f"such tensor (its {block} holds {held}); only llama-shaped q/k/v/o and "
                         f"gate/up/down projections are split")
    return parent


def _split(parent: nn.Module, name: str, *, axis: int, size: int, rank: int, where: str = "") -> None:
    """Keep part `rank` of `size` of parent.<name>'s weight along `axis` (0: output rows, 1: input
    columns), quantization scales and biases alike. A row split splits the bias too; a column split
    keeps the bias on rank 0 only, so that the sum across ranks adds it once."""
    layer = parent[name]
    if not isinstance(layer, (nn.Linear, nn.QuantizedLinear)):
        raise TypeError(f"cannot shard {name} of type {type(layer).__name__}: expected nn.Linear or nn.QuantizedLinear")
    arrays = ["weight", "scales", "biases"] if isinstance(layer, nn.QuantizedLinear) else ["weight"]
    if isinstance(layer, nn.QuantizedLinear) and axis == 1:
        groups = layer.scales.shape[1]
        if groups % size:
            raise ValueError(
                f"tensor parallel size {size}: {where} {name} has {groups} quantization groups of "
                f"{layer.group_size} input features, which {size} ranks cannot split evenly")
    for key in arrays:
        value = layer[key]
        step = value.shape[axis] // size
        layer[key] = value[rank * step:(rank + 1) * step] if axis == 0 else value[:, rank * step:(rank + 1) * step]
    if "bias" in layer:
        if axis == 0:
            step = layer.bias.shape[0] // size
            layer.bias = layer.bias[rank * step:(rank + 1) * step]
        elif rank != 0:
            layer.bias = mx.zeros_like(layer.bias)
