"""Per-row LoRA updates in one batched forward, never merged into the shared weights.

Each projection a LoRA adapter may target is wrapped (`install_lora`) by a module that computes the base
layer unchanged (the quantized CPU kernels, MLX's own layers) and, in a step with adapter rows, adds

    y[t] += (x[t] @ A[s_t]) @ B[s_t]          s_t = the slot of token t's adapter (0: none, zeros)

where the bank holds, per (layer, projection), every resident adapter stacked by slot with its scale
folded into B:

    A  (1 + max_loras, in, rank)     B  (1 + max_loras, rank, out)     rank = the largest resident rank
                                                                        (smaller ones zero-padded)

Gathered per row (mx.gather_mm with one slot index per token) rather than grouped by adapter: one pair
of matmuls per projection whatever the mix, the cost of the rank-r update of every row (T * r * (in +
out)), no host-side regrouping of the step's rows, and each row computed from its own slot alone, so a
row's result does not depend on which other adapters share its step. Steps without adapter rows skip
the update entirely (the wrappers call the base layer only).

Fused layers of the CPU kernels (metrale.models.cpu_quantized) keep their one call: qkv_proj adds each
of q, k, v's update to its output; gate_up_proj, whose kernel applies act(gate) * up in its epilogue,
is called without the epilogue in a step with adapter rows (gate and up come back interleaved by
16-row panel), gets the updates, then the same activation.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels import ext
from kernels.activations import gated_activation_fn
from kernels.qmm import PANEL, QuantizedLinearCPU, dequantized_matmul
from kernels.runtime import mx, nn
from metrale.models.lora_spec import AdapterSpec

__all__ = ["LoraBank", "install_lora", "load_adapter_weights"]

ModuleId = tuple[int, str]  # (layer index, "self_attn.q_proj")


def load_adapter_weights(spec: AdapterSpec, dtype: mx.Dtype) -> dict[ModuleId, tuple[mx.array, mx.array]]:
    """Each adapted module -> (A (in, r), scale * B (r, out)) in `dtype`, read from spec.weights_file."""
    tensors = mx.load(spec.weights_file)
    weights = {}
    for m in spec.modules:
        a, b = tensors[m.a_name].astype(mx.float32), tensors[m.b_name].astype(mx.float32)
        if m.transposed:  # PEFT: A (r, in), B (out, r)
            a, b = a.T, b.T
        weights[(m.layer, m.key)] = (a.astype(dtype), (b * spec.scale).astype(dtype))
    return weights


class LoraBank:
    """The resident adapters' weights by slot, and the current step's slot per token.

    `load(slot, weights)` / `clear(slot)` run between steps on the MLX thread; `token_slots` is set for
    the duration of one forward's graph building (the wrappers read it) and None otherwise."""

    def __init__(self, max_loras: int, dtype: mx.Dtype) -> None:
        self.num_slots = max_loras + 1  # slot 0: no adapter
        self.dtype = dtype
        self.rank = 0
        self.a: dict[ModuleId, mx.array] = {}  # (num_slots, in, rank)
        self.b: dict[ModuleId, mx.array] = {}  # (num_slots, rank, out)
        self.token_slots: mx.array | None = None  # (T,) uint32 during a forward with adapter rows

    def load(self, slot: int, weights: dict[ModuleId, tuple[mx.array, mx.array]]) -> None:
        """Put one adapter's weights in `slot` (1..max_loras), replacing what was there."""
        if not 1 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.num_slots - 1}")
        rank = max(a.shape[1] for a, _ in weights.values())
        if rank > self.rank:
            self._grow(rank)
        self.clear(slot)
        for module, (a, b) in weights.items():
            if module not in self.a:
                self.a[module] = mx.zeros((self.num_slots, a.shape[0], self.rank), dtype=self.dtype)
                self.b[module] = mx.zeros((self.num_slots, self.rank, b.shape[1]), dtype=self.dtype)
            self.a[module][slot, :, : a.shape[1]] = a
            self.b[module][slot, : b.shape[0], :] = b
        mx.eval(list(self.a.values()), list(self.b.values()))

    def clear(self, slot: int) -> None:
        for module in self.a:
            self.a[module][slot] = 0
            self.b[module][slot] = 0

    def _grow(self, rank: int) -> None:
        """Zero-pad every module's A columns and B rows to `rank` (the padding adds exact zeros)."""
        pad = rank - self.rank
        for module in self.a:
            self.a[module] = mx.pad(self.a[module], [(0, 0), (0, 0), (0, pad)])
            self.b[module] = mx.pad(self.b[module], [(0, 0), (0, pad), (0, 0)])
        self.rank = rank

    def delta(self, module: ModuleId, x: mx.array) -> mx.array | None:
        """x (T, in) -> each row's update (T, out), or None when no resident adapter targets `module`."""
        a = self.a.get(module)
        if a is None:
            return None
        slots = self.token_slots
        rows = x if x.dtype == self.dtype else x.astype(self.dtype)
        xa = mx.gather_mm(mx.expand_dims(rows, 1), a, rhs_indices=slots)  # (T, 1, rank)
        delta = mx.gather_mm(xa, self.b[module], rhs_indices=slots)  # (T, 1, out)
        return mx.squeeze(delta, 1)  # (T, out)


def _plus(y: mx.array, delta: mx.array | None) -> mx.array:
    if delta is None:
        return y
    return y + (delta if delta.dtype == y.dtype else delta.astype(y.dtype))


class LoraLinear(nn.Module):
    """A projection (or a fused set of projections of one input: q/k/v) plus each row's LoRA update."""

    def __init__(self, base: nn.Module, bank: LoraBank, layer: int, keys: Sequence[str]) -> None:
        super().__init__()
        self.base = base
        self._bank = bank
        object.__setattr__(self, "_targets", tuple((layer, key) for key in keys))  # not a parameter tree

    def __call__(self, x: mx.array) -> mx.array | tuple[mx.array, ...]:
        """x (T, in) -> (T, out), or a tuple of (T, out_j) for a fused layer."""
        out = self.base(x)
        if self._bank.token_slots is None:
            return out
        if isinstance(out, tuple):
            return tuple(_plus(y, self._bank.delta(m, x)) for y, m in zip(out, self._targets))
        return _plus(out, self._bank.delta(self._targets[0], x))


class LoraGatedLinear(nn.Module):
    """The CPU kernels' fused gate/up with act(gate) * up in the epilogue, plus each row's LoRA update on
    gate and up before the activation."""

    def __init__(self, base: QuantizedLinearCPU, bank: LoraBank, layer: int) -> None:
        super().__init__()
        self.base = base
        self._bank = bank
        object.__setattr__(self, "_gate", (layer, "mlp.gate_proj"))  # plain attributes, not parameter trees
        object.__setattr__(self, "_up", (layer, "mlp.up_proj"))
        self._activation = gated_activation_fn(base.glu)

    def __call__(self, x: mx.array) -> mx.array:
        """x (T, D) -> act(gate) * up (T, intermediate)."""
        if self._bank.token_slots is None or (self._gate not in self._bank.a and self._up not in self._bank.a):
            return self.base(x)
        gate, up = gate_and_up(self.base, x)
        return self._activation(_plus(gate, self._bank.delta(self._gate, x)), _plus(up, self._bank.delta(self._up, x)))


def gate_and_up(fused: QuantizedLinearCPU, x: mx.array) -> tuple[mx.array, mx.array]:
    """A glu-fused QuantizedLinearCPU's gate(x) and up(x) before the activation: x (T, K) -> 2 x (T, N).
    Its packed weight alternates gate and up panels of 16 rows, so one plain call gives (T, 2 * P * 16)."""
    num_tokens, width = x.shape[0], fused.columns[0]
    panels = -(-width // PANEL)
    columns = (2 * panels * PANEL,)
    x32 = x.astype(mx.float32)
    if fused.blas_rows is not None and x.size >= fused.blas_rows * fused.in_features:
        (out,) = dequantized_matmul(x32, fused["q"], fused["scales"], fused["biases"], bits=fused.bits, columns=columns)
    else:
        (out,) = ext.quantized_matmul(x32, fused["q"], fused["scales"], fused["biases"], bits=fused.bits,
                                      group_size=fused.group_size, columns=columns, glu=-1,
                                      activation_bits=fused.activation_bits, bias_per_scale=fused.bias_per_scale)
    pairs = out.reshape(num_tokens, panels, 2, PANEL)  # (T, P, [gate, up], 16)
    gate = pairs[:, :, 0].reshape(num_tokens, panels * PANEL)[:, :width]  # (T, N)
    up = pairs[:, :, 1].reshape(num_tokens, panels * PANEL)[:, :width]
    return gate.astype(x.dtype), up.astype(x.dtype)


def _wrap(parent: nn.Module, name: str, bank: LoraBank, layer: int, keys: Sequence[str]) -> int:
    if name not in parent:
        return 0
    base = parent[name]
    if isinstance(base, QuantizedLinearCPU) and base.glu is not None:
        setattr(parent, name, LoraGatedLinear(base, bank, layer))
    else:
        setattr(parent, name, LoraLinear(base, bank, layer, keys))
    return 1


def install_lora(model: nn.Module, bank: LoraBank) -> int:
    """Wrap the q, k, v, o, gate, up and down projections (fused or not) of a llama-family model in place;
    returns how many modules were wrapped."""
    count = 0
    for index, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        count += _wrap(attn, "qkv_proj", bank, index, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            count += _wrap(attn, name, bank, index, (f"self_attn.{name}",))
        count += _wrap(mlp, "gate_up_proj", bank, index, ())
        for name in ("gate_proj", "up_proj", "down_proj"):
            count += _wrap(mlp, name, bank, index, (f"mlp.{name}",))
    return count
