"""Per-row LoRA in one forward (metrale.models.lora driven by metrale.engine.lora_slots): a row with adapter A
in a batch mixing A, B and none equals a lone request with A, and equals the base with A merged into its
float weights; for llama and qwen3 shapes, mlx-lm and PEFT layouts, and a quantized base on the CPU kernels."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

import kernels.runtime  # noqa: F401

import mlx.core as mx  # noqa: E402

from metrale.engine.lora_slots import LoraSlots  # noqa: E402
from metrale.loading import load_model  # noqa: E402
from metrale.models.lora import gate_and_up  # noqa: E402
from kernels.qmm import QuantizedLinearCPU  # noqa: E402
from scheduler import LoraRef, ScheduledRequest  # noqa: E402
from tests.metrale.arch_helpers import arch_folder, quantized_folder  # noqa: E402
from tests.metrale.lora_helpers import merge_into, random_adapter, write_mlx_adapter, write_peft_adapter  # noqa: E402
from tests.metrale.model_helpers import PagedHarness  # noqa: E402

PROMPTS = {"a1": [5, 17, 33, 2, 9, 41, 7], "b": [3, 8, 60, 12], "n": [44, 1, 90, 23, 6], "a2": [70, 11, 4]}


def _adapters(tmp_path: Path, config) -> tuple[LoraRef, LoraRef, dict, dict]:
    """Adapter A (mlx-lm layout, rank 4, every projection, scale 1.5) and B (PEFT layout, rank 8, q/v/down only,
    alpha 16: scale 2), with their unscaled weights."""
    weights_a = random_adapter(config, 4, seed=1)
    weights_b = random_adapter(config, 8, keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"), seed=2)
    a = write_mlx_adapter(tmp_path / "A", weights_a, rank=4, scale=1.5)
    b = write_peft_adapter(tmp_path / "B", weights_b, rank=8, alpha=16.0)
    return LoraRef("A", str(a)), LoraRef("B", str(b)), weights_a, weights_b


def _run(model, config, slots: LoraSlots | None, chunks: list[tuple[str, list[int], LoraRef | None]]) -> dict:
    """One prefill step then one decode step of each sequence; its last rows' logits by name, (2, V) each."""
    harness = PagedHarness(config)
    out: dict[str, list[mx.array]] = {name: [] for name, _, _ in chunks}
    steps = [[(n, p, r) for n, p, r in chunks], [(n, [p[0]], r) for n, p, r in chunks]]
    for step in steps:
        scheduled = [ScheduledRequest(name, tuple(tokens), 0, (), True, lora=ref) for name, tokens, ref in step]
        context = slots.step(scheduled) if slots is not None else contextlib.nullcontext()
        with context:
            logits = harness.step(model, [(name, tokens) for name, tokens, _ in step])
        for (name, _, _), rows in zip(step, logits):
            out[name].append(rows[-1])
    return {name: mx.stack(rows) for name, rows in out.items()}


def _slots(loaded, max_loras: int = 2) -> LoraSlots:
    return LoraSlots(loaded.model, loaded.config, max_loras, 16, loaded.dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_row_equals_lone_request_and_merged_weights(tmp_path, arch):
    folder = arch_folder(tmp_path, arch)
    loaded = load_model(folder)
    config = loaded.config
    ref_a, ref_b, weights_a, weights_b = _adapters(tmp_path, config)
    slots = _slots(loaded)
    mixed = _run(loaded.model, config, slots, [("a1", PROMPTS["a1"], ref_a), ("b", PROMPTS["b"], ref_b),
                                               ("n", PROMPTS["n"], None), ("a2", PROMPTS["a2"], ref_a)])
    lone_a = _run(loaded.model, config, slots, [("a1", PROMPTS["a1"], ref_a)])
    lone_none = _run(loaded.model, config, slots, [("n", PROMPTS["n"], None)])
    base = load_model(folder)
    plain = _run(base.model, config, None, [("a1", PROMPTS["a1"], None), ("n", PROMPTS["n"], None)])
    merge_into(base.model, weights_a, 1.5)
    merged = _run(base.model, config, None, [("a1", PROMPTS["a1"], None), ("a2", PROMPTS["a2"], None)])
    with_b = load_model(folder)
    merge_into(with_b.model, weights_b, 16.0 / 8)
    merged_b = _run(with_b.model, config, None, [("b", PROMPTS["b"], None)])

    assert mx.abs(mixed["a1"] - lone_a["a1"]).max().item() < 1e-4
    assert mx.array_equal(mx.argmax(mixed["a1"], axis=-1), mx.argmax(lone_a["a1"], axis=-1))
    assert mx.abs(mixed["a1"] - merged["a1"]).max().item() < 1e-4
    assert mx.abs(mixed["a2"] - merged["a2"]).max().item() < 1e-4
    assert mx.abs(mixed["b"] - merged_b["b"]).max().item() < 1e-4  # PEFT's transposed layout and alpha / r
    assert mx.abs(mixed["n"] - plain["n"]).max().item() < 1e-4  # a row without an adapter adds nothing
    assert mx.abs(lone_none["n"] - plain["n"]).max().item() < 1e-5  # a step without adapters: the base only
    assert mx.abs(mixed["a1"] - plain["a1"]).max().item() > 0.05  # the adapter changes the output


def test_peft_layout_with_rslora_equals_the_same_adapter_in_mlx_layout(tmp_path):
    folder = arch_folder(tmp_path, "llama")
    loaded = load_model(folder)
    weights = random_adapter(loaded.config, 4, seed=3)
    peft = write_peft_adapter(tmp_path / "peft", weights, rank=4, alpha=8.0, rslora=True, dtype=mx.float16)
    mlx_layout = write_mlx_adapter(tmp_path / "mlx", {k: (a.astype(mx.float16).astype(mx.float32),
                                                         b.astype(mx.float16).astype(mx.float32))
                                                      for k, (a, b) in weights.items()}, rank=4, scale=8.0 / 2.0)
    slots = _slots(loaded)
    got = _run(loaded.model, loaded.config, slots, [("p", PROMPTS["a1"], LoraRef("p", str(peft))),
                                                     ("m", PROMPTS["a1"], LoraRef("m", str(mlx_layout)))])
    assert mx.abs(got["p"] - got["m"]).max().item() < 1e-4


def test_quantized_base_mixed_row_equals_lone(tmp_path):
    folder = quantized_folder(tmp_path, "llama")
    loaded = load_model(folder)
    assert any(isinstance(m, QuantizedLinearCPU) and m.glu for m in loaded.model.modules()), "kernels not in use"
    ref_a, ref_b, _, _ = _adapters(tmp_path, loaded.config)
    slots = _slots(loaded)
    mixed = _run(loaded.model, loaded.config, slots, [("a1", PROMPTS["a1"], ref_a), ("b", PROMPTS["b"], ref_b),
                                                      ("n", PROMPTS["n"], None), ("a2", PROMPTS["a2"], ref_a)])
    lone = _run(loaded.model, loaded.config, slots, [("a1", PROMPTS["a1"], ref_a)])
    base = _run(loaded.model, loaded.config, slots, [("a1", PROMPTS["a1"], None)])
    assert mx.abs(mixed["a1"] - lone["a1"]).max().item() < 1e-3
    assert mx.array_equal(mx.argmax(mixed["a1"], axis=-1), mx.argmax(lone["a1"], axis=-1))
    assert mx.abs(lone["a1"] - base["a1"]).max().item() > 0.05


def test_gate_and_up_before_the_epilogue_match_the_fused_call(tmp_path):
    loaded = load_model(quantized_folder(tmp_path, "llama"))
    mlp = loaded.model.model.layers[0].mlp
    x = mx.random.normal((5, loaded.config.hidden_size), key=mx.random.key(0))
    gate, up = gate_and_up(mlp.gate_up_proj, x)
    assert mx.abs(mlp._gated_activation(gate, up) - mlp.gate_up_proj(x)).max().item() < 1e-4


def test_eviction_keeps_adapters_of_running_requests(tmp_path):
    loaded = load_model(arch_folder(tmp_path, "llama"))
    config = loaded.config
    refs = []
    for i in range(3):
        weights = random_adapter(config, 2, keys=("self_attn.q_proj",), seed=10 + i)
        refs.append(LoraRef(f"L{i}", str(write_mlx_adapter(tmp_path / f"L{i}", weights, rank=2, scale=1.0))))
    slots = _slots(loaded, max_loras=2)
    _run(loaded.model, config, slots, [("r0", [1, 2], refs[0]), ("r1", [3, 4], refs[1])])
    with pytest.raises(RuntimeError, match="max_loras"):  # both slots pinned by running requests
        _run(loaded.model, config, slots, [("r2", [5, 6], refs[2])])
    slots.forget(["r0"])
    _run(loaded.model, config, slots, [("r2", [5, 6], refs[2])])
    assert slots.resident == ("L1", "L2") and slots.num_loads == 3
    slots.forget(["r1", "r2"])
    _run(loaded.model, config, slots, [("r3", [5, 6], refs[0])])  # evicted L1 (least recent), reloads L0
    assert slots.resident == ("L2", "L0") and slots.num_loads == 4
