"""KernelSettings (kernels/settings.py): the kernels' part of the runtime settings, and how it reaches the
backend choices and the compiled extension."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import backend, ext
from kernels.settings import KernelSettings, applied, current

ROOT = str(Path(__file__).resolve().parents[2])
needs_kernel = pytest.mark.skipif(ext.load() is None, reason="CPU kernels not built (python -m kernels.build)")


def test_without_settings_applied_the_environment_is_read_at_each_decision(monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "reference")
    assert current().attention == "reference" and backend.attention_backend() == "reference"
    monkeypatch.setenv("METRALE_QMM_ACTIVATIONS", "int8")
    assert backend.matmul_activation_bits() == 8
    monkeypatch.setenv("METRALE_QMM_ACTIVATIONS", "INT12")
    assert backend.matmul_activation_bits() == 12
    assert [backend.activation_bits_for(12, t) for t in (1, 512)] == [12, 12]  # fixed per policy, not per call


def test_applied_settings_win_over_the_environment_and_end_with_the_block(monkeypatch):
    monkeypatch.setenv("METRALE_KERNELS", "reference")
    with applied(KernelSettings(activations="auto", qmm_activations="int8")):
        assert backend.matmul_activation_bits() == 8
        assert backend.activation_backend() == ("kernel" if ext.has_activation_kernels() else "reference")
    assert backend.activation_backend() == "reference"
    assert backend.select_backends(KernelSettings(attention="reference")).attention == "reference"


def test_auto_activations_choose_int8_for_prompt_chunks_only(monkeypatch):
    monkeypatch.delenv("METRALE_QMM_ACTIVATIONS", raising=False)
    assert backend.matmul_activation_bits() == 12  # the default (auto costs quality: docs/quantized-kernels.md)
    monkeypatch.setenv("METRALE_QMM_ACTIVATIONS", "auto")
    assert backend.matmul_activation_bits() == 0
    low = backend.INT8_MIN_TOKENS - 1
    assert [backend.activation_bits_for(0, t) for t in (1, low, backend.INT8_MIN_TOKENS, 512)] == [16, 16, 8, 8]
    assert [backend.activation_bits_for(bits, t) for bits in (16, 8) for t in (1, 512)] == [16, 16, 8, 8]


@needs_kernel
def test_an_auto_layer_computes_each_call_at_its_chosen_precision():
    """A QuantizedLinearCPU built under auto gives, per call, exactly the output of its chosen precision."""
    import mlx.core as mx
    import mlx.nn as nn

    from kernels.qmm import QuantizedLinearCPU

    linear = nn.QuantizedLinear(256, 48, bias=False, group_size=32, bits=4)
    with applied(KernelSettings(qmm_activations="auto")):
        layer = QuantizedLinearCPU.from_layers([linear])
    assert layer.activation_bits == 0 and "activations=auto" in repr(layer)
    for tokens, bits in ((backend.INT8_MIN_TOKENS - 1, 16), (backend.INT8_MIN_TOKENS, 8), (40, 8)):
        x = mx.random.normal((tokens, 256), key=mx.random.key(tokens))
        (want,) = ext.quantized_matmul(x, layer.q, layer.scales, layer.biases, bits=4, group_size=32,
                                       columns=[48], activation_bits=bits)
        assert mx.array_equal(layer(x), want), (tokens, bits)


@pytest.mark.parametrize("field, value", [("attention", "fast"), ("qmm_activations", "int4"),
                                          ("attention_threads", 0), ("spin_us", -5)])
def test_bad_values_are_refused_at_construction(field, value):
    with pytest.raises(ValueError):
        KernelSettings(**{field: value})


@needs_kernel
def test_the_extension_takes_its_threads_and_instruction_set_from_the_settings():
    code = ("import kernels.runtime; from kernels import ext; m = ext.load(); "
            "print(m.num_threads() if hasattr(m, 'num_threads') else 'old build', m.cpu_isa())")
    env = dict(os.environ, PYTHONPATH=ROOT, METRALE_ATTENTION_THREADS="3", METRALE_CPU_ISA="scalar",
               METRALE_SPIN_US="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    threads, isa = out.stdout.split()
    assert isa == "scalar" and threads in ("3", "old")
