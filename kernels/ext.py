"""The compiled CPU kernels (an MLX extension): quantized matmul, paged decode attention, causal
softmax and fused gated activations (SwiGLU / GeGLU); without them the plain-MLX reference runs.

The kernels are compiled once per instruction set (scalar, avx2, avx512, avx512_amx on x86-64;
scalar, neon, neon_dotprod on arm64) and the
best one this CPU runs is chosen when the module loads; KernelSettings.cpu_isa (METRALE_CPU_ISA=scalar|...)
asks for another (a set the CPU lacks refuses the kernels, with the reason). `cpu_isa()` says which one
runs. The load applies the settings in force (kernels.settings.current(): the engine's when it builds its
model, else the environment's) to the module once per process: its instruction set, threads and spin.

Build with `python -m kernels.build` (it writes kernels/_kernels*.so, ignored by git). `load()`
returns the compiled module, or None when it is not built, fails to load, or was built against
another mlx version (its C++ ABI would not be safe to call).
"""

from __future__ import annotations

import importlib
import logging

from kernels.settings import DEFAULT_SPIN_US, KernelSettings, current

logger = logging.getLogger(__name__)

MODULE = "kernels._kernels"
_ACTIVATION_OPS = ("silu_mul", "gelu_tanh_mul")
_QMM_OPS = ("quantized_matmul", "quantized_rows", "cpu_isa", "pack_panels")
_state: dict[str, object] = {}


def load():
    """The compiled extension module, or None; decided (and logged) once per process."""
    if "module" in _state:
        return _state["module"]
    from kernels.runtime import mx

    module = None
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != MODULE:
            raise
        logger.info("CPU kernels not built (python -m kernels.build); using the plain-MLX reference")
    except ImportError as exc:
        logger.warning("CPU kernels failed to load (%s); using the plain-MLX reference. Rebuild: "
                       "python -m kernels.build", exc)
    if module is not None and module.mlx_version != mx.__version__.split(".dev")[0]:
        logger.warning("CPU kernels were built for mlx %s but mlx %s is installed; using the plain-MLX "
                       "reference. Rebuild: python -m kernels.build", module.mlx_version, mx.__version__)
        module = None
    if module is not None:
        module = _configured(module, current())
    if module is not None and not _smoke_test(module, mx):
        module = None
    _state["module"] = module
    return module


def _configured(module, settings: KernelSettings):
    """The module set up as `settings` say (before any kernel runs: the thread count is fixed by the first),
    or None when it refuses the instruction set. A build that predates the thread setters reads
    METRALE_ATTENTION_THREADS and METRALE_SPIN_US itself."""
    if settings.cpu_isa != "auto":
        try:
            module.set_cpu_isa(settings.cpu_isa)
        except ValueError as exc:
            logger.warning("CPU kernels refused METRALE_CPU_ISA=%s (%s); using the plain-MLX reference",
                           settings.cpu_isa, exc)
            return None
    if hasattr(module, "set_num_threads"):
        module.set_num_threads(settings.attention_threads or 0)
        module.set_spin_us(DEFAULT_SPIN_US if settings.spin_us is None else settings.spin_us)
    return module


def _smoke_test(module, mx) -> bool:
    """One tiny call: a nanobind ABI that differs from mlx's shows up here as a TypeError."""
    pool = mx.ones((1, 1, 4, 8))  # (num_blocks, n_kv_heads, block_size, head_dim)
    try:
        out = module.paged_decode(mx.ones((1, 2, 8)), pool, pool, mx.zeros((1, 1), dtype=mx.int32),
                                  mx.array([3], dtype=mx.int32), scale=1.0, block_size=4, window=0)
    except TypeError as exc:
        logger.warning("CPU kernels reject mlx arrays (%s): nanobind differs from the one mlx was "
                       "built with; using the plain-MLX reference", exc)
        return False
    if not bool(mx.allclose(out, mx.ones((1, 2, 8)))):
        logger.warning("CPU kernels failed their self-check; using the plain-MLX reference")
        return False
    return True


def has_activation_kernels() -> bool:
    """True when the loaded extension has the gated-activation kernels (a build that predates them
    is reported once: rebuild with python -m kernels.build)."""
    module = load()
    if module is None:
        return False
    if "activations" not in _state:
        _state["activations"] = all(hasattr(module, name) for name in _ACTIVATION_OPS)
        if not _state["activations"]:
            logger.warning("kernels/_kernels was built before the activation kernels; using the MLX "
                           "expression. Rebuild: python -m kernels.build")
    return bool(_state["activations"])


def has_qmm_kernels() -> bool:
    """True when the loaded extension has the quantized matmul kernels (an older build is reported
    once: rebuild with python -m kernels.build)."""
    module = load()
    if module is None:
        return False
    if "qmm" not in _state:
        _state["qmm"] = all(hasattr(module, name) for name in _QMM_OPS)
        if not _state["qmm"]:
            logger.warning("kernels/_kernels was built before the quantized matmul kernels; quantized weights "
                           "are dequantized to float32. Rebuild: python -m kernels.build")
    return bool(_state["qmm"])


def cpu_isa() -> str | None:
    """The instruction set the loaded kernels run with ("scalar", "avx2", "avx512"), None without them."""
    module = load()
    return module.cpu_isa() if module is not None and hasattr(module, "cpu_isa") else None


def supported_isas() -> list[str]:
    """The kernel sets this build has and this CPU runs, best last; [] without the extension."""
    module = load()
    return list(module.supported_isas()) if module is not None and hasattr(module, "supported_isas") else []


def set_cpu_isa(name: str) -> None:
    """Run the kernels of instruction set `name` ("auto" = the best); ValueError if this CPU or build
    lacks it. For tests and benchmarks, between evaluations."""
    _module().set_cpu_isa(name)


def _module():
    module = _state.get("module")  # load()'s decision, once made (per-call path of every kernel op)
    if module is None:
        module = load()
        if module is None:
            raise RuntimeError("CPU kernels are not available: check kernels.ext.load() first")
    return module


def paged_decode(queries, k_pool, v_pool, block_tables, context_lens, *, scale, block_size, window):
    """Decode attention read straight from the pools (kernels/csrc/paged_decode.cpp).

    queries (B, n_heads, hd), pools (num_blocks, n_kv_heads, block_size, hd), block_tables (B, max_blocks)
    int32, context_lens (B,) int32; window 0 means none. Returns (B, n_heads, hd). Needs load().
    """
    return _module().paged_decode(
        queries, k_pool, v_pool, block_tables, context_lens,
        scale=float(scale), block_size=int(block_size), window=int(window),
    )


def has_paged_prefill() -> bool:
    """True when the loaded extension has the paged prefill kernel (an older build lacks it)."""
    module = load()
    return module is not None and hasattr(module, "paged_prefill")


def paged_prefill(queries, k_pool, v_pool, block_table, *, first_position, scale, block_size, window):
    """Prefill attention of one sequence's chunk read straight from the pools, flash style
    (kernels/csrc/paged_prefill.cpp): queries (q_len, n_heads, hd) at positions first_position..,
    pools (num_blocks, n_kv_heads, block_size, hd), block_table (max_blocks,) int32; window 0 means none.
    Returns (q_len, n_heads, hd) float32. Needs load()."""
    return _module().paged_prefill(
        queries, k_pool, v_pool, block_table,
        first_position=int(first_position), scale=float(scale), block_size=int(block_size), window=int(window),
    )


def causal_softmax(scores, *, offset, window):
    """Softmax of scores (..., q_len, L) float32 for each query row i over the keys j with
    j <= i + offset (and j > i + offset - window when window > 0); 0 elsewhere. Needs load()."""
    return _module().causal_softmax(scores, offset=int(offset), window=int(window))


def silu_mul(gate, up):
    """gate * sigmoid(gate) * up in one vectorized pass (kernels/csrc/activations.cpp).

    gate, up: the same shape and dtype, float32|float16|bfloat16 (half types computed in float32);
    returns that shape and dtype, ValueError otherwise. CPU stream. Needs load().
    """
    return _module().silu_mul(gate, up)


def gelu_tanh_mul(gate, up):
    """gelu_pytorch_tanh(gate) * up = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up, as silu_mul."""
    return _module().gelu_tanh_mul(gate, up)


def quantized_matmul(x, q, scales, biases, *, bits, group_size, columns, glu=-1, activation_bits=16,
                     bias_per_scale=0.0):
    """x (..., K) float32 times a packed affine weight (kernels/qmm.py): a list with one float32
    (..., columns[j]) per output j; glu 0 (silu) / 1 (gelu_tanh) fuses act(gate) * up; x is
    quantized per 32 values to int8, int12 or int16 (activation_bits 8 | 12 | 16); bias_per_scale
    nonzero only where every bias is exactly that times its scale (qmm.symmetric_bias_per_scale). Needs load()."""
    return _module().quantized_matmul(x, q, scales, biases, bits=bits, group_size=group_size, columns=columns,
                                      glu=glu, activation_bits=activation_bits, bias_per_scale=bias_per_scale)


def quantized_rows(q, scales, biases, ids, *, bits, group_size, rows):
    """Rows `ids` of a packed weight of `rows` rows, dequantized: (*ids.shape, K) float32. Needs load()."""
    return _module().quantized_rows(q, scales, biases, ids, bits=int(bits), group_size=int(group_size),
                                    rows=int(rows))


def pack_panels(packed, scales, biases, *, bits, group_size, interleave=False, huge_pages=True):
    """MLX affine weights (lists, one per layer) in the kernels' panel layout, written once into their final
    buffers (kernels/csrc/weight_layout.cpp; kernels.qmm.pack_layers is the caller). Needs load()."""
    return _module().pack_panels(packed, scales, biases, bits=int(bits), group_size=int(group_size),
                                 interleave=bool(interleave), huge_pages=bool(huge_pages))


def huge_page_copy(a):
    """`a` copied into memory advised for 2 MiB transparent huge pages (kernels/csrc/weight_layout.cpp), for the
    buffers a decode step streams whole (packed weights): on 4 KiB pages each page of the stream costs a
    TLB miss. `a` itself where THP is off, `a` is under 2 MiB, or the extension is not built (or is an
    older build without the binding)."""
    module = load()
    if module is None or not hasattr(module, "huge_page_copy"):
        return a
    return module.huge_page_copy(a)


def anon_huge_page_bytes() -> int:
    """This process's bytes on transparent huge pages (AnonHugePages of /proc/self/smaps_rollup), -1
    where unknown (not Linux, or the extension lacks the binding)."""
    module = load()
    if module is None or not hasattr(module, "anon_huge_page_bytes"):
        return -1
    return int(module.anon_huge_page_bytes())
