"""Sampling kernels, threaded over rows on the CPU (kernels/csrc/sampling*): the greedy argmax and the
full-vocabulary inverse CDF of temperature (+ min_p) rows, for metrale.sampling.

argmax (argmax_fn): MLX's CPU argmax is one thread, ~10-13 ms for the (32, 128256) float32 logits of a
32-stream decode step of a Llama-3-vocabulary model; the kernel splits rows (and, for fewer rows than
threads, ranges of a row) over the kernel pool: ~0.7 ms (AVX-512), 0.29-0.34 ms on the 2-core AVX2 Zen 3
(where it took 7.4 ms, slower than mx.argmax's 4.7, until its loop stopped compiling to scalar code:
kernels/csrc/sampling_kernel.h). The answer is mx.argmax(x, axis=-1)'s, bit for bit:

    dtype     uint32, shape x.shape[:-1]
    ties      the first index of the maximum (-0.0 and +0.0 tie; a row of -inf gives 0)
    NaN       counts as larger than every number: the first NaN's index (checked against mlx 0.32)

full-vocabulary sampling (sample_full_fn): metrale.sampling.ops.sample_full's arithmetic in one node,
~35 ms of MLX ops (its CPU power is scalar) -> a few ms at (32, 128256). The same distribution; its running
mass is summed in another order (blocks of 64, see kernels/csrc/sampling_kernel.h), so a uniform that
falls within float rounding of a token boundary may pick the neighbour; NaN logits get no mass.

top_k / top_p sampling (sample_candidates_fn): metrale.sampling.ops.sample_candidates in one node, by O(V)
selection (kernels/csrc/sampling_select.h: a bound from block maxima for top_k and for a peaked nucleus, a
histogram of masses over y = (x - max) * scale for a wide one) instead of MLX's partition and sort of K
candidates, and for a top_p row whose nucleus passes its 256 candidates (flat logits: random weights, or
temperature >= 1) the x8 retries and the whole vocabulary's sort. Measured at (32, 128256) on this project's
2 shared cores under load ~13 (benchmarks/sampler_bench.py --vocab 128256 --backends kernel,reference, medians):
top_k 40 25 -> 16 ms, top_k 50 + top_p 0.9 26 -> 10 ms, top_p 0.9 LM-like 142 -> 24 ms, top_p 0.9 flat
2444 -> 52 ms. Ties with the k-th value all survive top_k (the reference keeps only those among its K
candidates); ties in the descending order go lower index first; the nucleus is normalized by the whole
vocabulary's mass summed in double (the reference: float32), so a uniform or top_p within float rounding of a
token boundary may pick the neighbour. NaN logits get no mass and count after every number.

top-n ids (top_ids_fn): the raw logprobs' n largest per row (n <= 20), descending, ties lower index first (as
ops.largest's stable sort where it sorts the whole row), NaN last: the same block bound, then a small sort.

logsumexp (logsumexp_fn): the raw logprobs' normalizer per row, vectorized: ~60 ms of MLX ops at (32, 128256)
-> ~1-2 ms; within float32 rounding of MLX's (a NaN where the row's maximum is not finite, as MLX's).

Chosen once, like the other kernels (kernels.backend.activation_backend, METRALE_KERNELS): "kernel" on CPU
with an extension that has them; float32 logits only (other dtypes, a GPU, the reference backend and an
older build run the MLX ops).
"""

from __future__ import annotations

from collections.abc import Callable

from kernels import ext
from kernels.backend import activation_backend
from kernels.runtime import mx

__all__ = ["argmax_fn", "has_argmax_kernel", "logsumexp_fn", "reference_logsumexp", "sample_candidates_fn",
           "sample_full_fn", "top_ids_fn"]

Argmax = Callable[[mx.array], mx.array]
# logits (R, V) float32, scale (R,), log2_min_p (R,), uniforms (R,) float32 -> tokens (R,) int32
SampleFull = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]
# logits (R, V) float32, scale (R,), log2_min_p (R,), top_k (R,) int32, top_p (R,), uniforms (R,) -> (R,) int32
SampleCandidates = Callable[[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array], mx.array]
# x (R, V) float32, n (1 <= n <= V) -> (R, n) int32 ids of the n largest values, descending
TopIds = Callable[[mx.array, int], mx.array]


def _kernel(name: str, backend: str | None):
    """The extension's `name` kernel where `backend` ("kernel" | "reference", None: activation_backend())
    runs kernels and the loaded build has it (a build that predates it lacks it); else None."""
    backend = activation_backend() if backend is None else backend
    module = ext.load() if backend == "kernel" else None
    return getattr(module, name, None) if module is not None else None


def has_argmax_kernel() -> bool:
    """True when the loaded extension has the argmax kernel."""
    return _kernel("argmax_rows", "kernel") is not None


def _reference(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def argmax_fn(backend: str | None = None) -> Argmax:
    """x (..., V) -> (...) uint32, the index of each row's maximum, as mx.argmax(x, axis=-1).
    `backend`: "kernel" | "reference" (None: activation_backend())."""
    kernel = _kernel("argmax_rows", backend)
    if kernel is None:
        return _reference

    def argmax(x: mx.array) -> mx.array:
        if x.dtype == mx.float32 and x.ndim >= 1 and x.shape[-1] >= 1:
            return kernel(x)
        return _reference(x)

    return argmax


def sample_full_fn(backend: str | None = None) -> SampleFull | None:
    """The full-vocabulary sampling kernel (see the module docstring), or None where the MLX ops run: the
    reference backend, no kernel in the build. It takes float32 logits only (the caller checks)."""
    return _kernel("sample_full_rows", backend)


def sample_candidates_fn(backend: str | None = None) -> SampleCandidates | None:
    """The top_k / top_p sampling kernel (see the module docstring), or None where the MLX ops run. It takes
    float32 logits only (the caller checks)."""
    return _kernel("sample_candidates_rows", backend)


def top_ids_fn(backend: str | None = None) -> TopIds | None:
    """The top-n ids kernel (see the module docstring), or None where the MLX ops run. It takes float32 (R, V)
    and 1 <= n <= V only (the caller checks)."""
    return _kernel("top_ids_rows", backend)


LOG2E = 1.4426950408889634  # exp(z) as 2**(z*log2 e): same float32 accuracy, ~3x faster on MLX CPU


def reference_logsumexp(x: mx.array) -> mx.array:
    """x (R, V) -> (R,) in MLX ops (exp as 2^(x log2 e): MLX's CPU exp is slower)."""
    top = x.max(axis=-1, keepdims=True)  # (R, 1)
    return (top + mx.log(mx.power(2.0, (x - top) * LOG2E).sum(axis=-1, keepdims=True)))[:, 0]  # (R,)


def logsumexp_fn(backend: str | None = None) -> Callable[[mx.array], mx.array]:
    """x (R, V) -> (R,) float32 log(sum(exp(x))) per row: the kernel on float32 input where the backend
    has it, else MLX's ops."""
    kernel = _kernel("logsumexp_rows", backend)
    if kernel is None:
        return reference_logsumexp

    def logsumexp(x: mx.array) -> mx.array:
        return kernel(x) if x.dtype == mx.float32 and x.ndim == 2 and x.shape[-1] >= 1 else reference_logsumexp(x)

    return logsumexp
