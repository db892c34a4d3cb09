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


def test_applied_settings_win_over_the_environment_and_end_with_the_block(monkeypatch):
    monkeypatch.setenv("METRALE_KERNELS", "reference")
    with applied(KernelSettings(activations="auto", qmm_activations="int8")):
        assert backend.matmul_activation_bits() == 8
        assert backend.activation_backend() == ("kernel" if ext.has_activation_kernels() else "reference")
    assert backend.activation_backend() == "reference"
    assert backend.select_backends(KernelSettings(attention="reference")).attention == "reference"


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
