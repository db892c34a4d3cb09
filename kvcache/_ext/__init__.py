"""Optional C++ CPU kernels for kvcache (an MLX extension): paged decode attention, causal softmax
and fused gated activations (SwiGLU / GeGLU); without them the plain-MLX reference runs.

Build with `python -m kvcache._ext.build` (it writes kvcache/_ext/_kernels*.so, ignored by
git). `load()` returns the compiled module, or None when it is not built, fails to load, or was
built against another mlx version (its C++ ABI would not be safe to call).
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

MODULE = f"{__name__}._kernels"
_state: dict[str, object] = {}


def load():
    """The compiled extension module, or None; decided (and logged) once per process."""
    if "module" in _state:
        return _state["module"]
    import mlx.core as mx

    module = None
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != MODULE:
            raise
        logger.info("attention kernels not built (python -m kvcache._ext.build); using reference attention")
    except ImportError as exc:
        logger.warning("attention kernels failed to load (%s); using reference attention. Rebuild: "
                       "python -m kvcache._ext.build", exc)
    if module is not None and module.mlx_version != mx.__version__.split(".dev")[0]:
        logger.warning("attention kernels was built for mlx %s but mlx %s is installed; using reference "
                       "attention. Rebuild: python -m kvcache._ext.build", module.mlx_version, mx.__version__)
        module = None
    if module is not None and not _smoke_test(module, mx):
        module = None
    _state["module"] = module
    return module


def _smoke_test(module, mx) -> bool:
    """One tiny call: a nanobind ABI that differs from mlx's shows up here as a TypeError."""
    pool = mx.ones((4, 1, 8))  # (num_slots, n_kv_heads, head_dim)
    try:
        out = module.paged_decode(mx.ones((1, 2, 8)), pool, pool, mx.zeros((1, 1), dtype=mx.int32),
                                  mx.array([3], dtype=mx.int32), scale=1.0, block_size=4, window=0)
    except TypeError as exc:
        logger.warning("attention kernels reject mlx arrays (%s): nanobind differs from the one mlx was "
                       "built with; using reference attention", exc)
        return False
    if not bool(mx.allclose(out, mx.ones((1, 2, 8)))):
        logger.warning("attention kernels failed their self-check; using reference attention")
        return False
    return True


def _module():
    module = load()
    if module is None:
        raise RuntimeError("attention kernels are not available: check kvcache._ext.load() first")
    return module


def paged_decode(queries, k_pool, v_pool, block_tables, context_lens, *, scale, block_size, window):
    """Decode attention read straight from the pools (kvcache/_ext/paged_decode.cpp).

    queries (B, n_heads, hd), pools (num_slots, n_kv_heads, hd), block_tables (B, max_blocks)
    int32, context_lens (B,) int32; window 0 means none. Returns (B, n_heads, hd). Needs load().
    """
    return _module().paged_decode(
        queries, k_pool, v_pool, block_tables, context_lens,
        scale=float(scale), block_size=int(block_size), window=int(window),
    )


def causal_softmax(scores, *, offset, window):
    """Softmax of scores (..., q_len, L) float32 for each query row i over the keys j with
    j <= i + offset (and j > i + offset - window when window > 0); 0 elsewhere. Needs load()."""
    return _module().causal_softmax(scores, offset=int(offset), window=int(window))


def silu_mul(gate, up):
    """gate * sigmoid(gate) * up in one vectorized pass (kvcache/_ext/activations.cpp).

    gate, up: the same shape and dtype, float32|float16|bfloat16 (half types computed in float32);
    returns that shape and dtype, ValueError otherwise. CPU stream. Needs load().
    """
    return _module().silu_mul(gate, up)


def gelu_tanh_mul(gate, up):
    """gelu_pytorch_tanh(gate) * up = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up, as silu_mul."""
    return _module().gelu_tanh_mul(gate, up)
