"""RuntimeSettings: how this process runs, decided once at start from EngineConfig, flags and the environment.

`RuntimeSettings.resolve(config, ...)` is the one place metrale reads its METRALE_* variables (the kernel
ones through kernels.settings.KernelSettings.from_environ, the floor that needs them). The engine builds one
when it starts and passes it down: its kernel part to loading, the models, the KV pools and the kernels
(kernels.settings.applied), the failpoints to the engine and the text front-end, the step timeout to the
tensor-parallel group. `ENVIRONMENT` is the table docs/settings.md shows (tests/metrale/test_settings.py keeps
the two and the code in step). Never imports mlx.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kernels.settings import KernelSettings, environ_number
from metrale.config import EngineConfig

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MIN_ENGINE_HANG_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Variable:
    """One row of the table: an environment variable, what it sets, its default and where it is used."""

    name: str
    setting: str  # the RuntimeSettings field (dotted for the kernel part)
    default: str
    meaning: str


ENVIRONMENT = (
    Variable("METRALE_ATTENTION", "kernels.attention", "auto", "auto, kernel or reference: paged attention "
             "(decode rows, prefill softmax, K/V writes) through the CPU kernels or plain MLX"),
    Variable("METRALE_KERNELS", "kernels.activations", "auto", "auto, kernel or reference: gated activations "
             "(SwiGLU, GeGLU), fused RMSNorm and RoPE"),
    Variable("METRALE_MATMUL", "kernels.matmul", "auto", "auto, kernel or reference: quantized linear layers "
             "through the CPU kernels (reference: MLX's quantized_matmul; on CPU the loader then dequantizes)"),
    Variable("METRALE_QMM_ACTIVATIONS", "kernels.qmm_activations", "int12", "int12, int16, int8, or auto (int8 "
             "for calls of 16+ token rows: prompt chunks): activation precision of the quantized matmul kernels "
             "(int12: 1.2-1.3x int16 on AMX, 16x finer than int8; int16: 16x finer than int12; int8, llama.cpp's "
             "arithmetic, is faster (1.6-1.7x int12 on AVX2-only CPUs) and flips some greedy tokens; "
             "auto also makes outputs depend on batching)"),
    Variable("METRALE_CPU_ISA", "kernels.cpu_isa", "auto", "auto, scalar, avx2, avx512 or avx512_amx "
             "(x86-64), neon or neon_dotprod (arm64) (AMX int8 tiles for prompt chunks; avx512 turns "
             "them off): force the kernels' instruction set (a set the CPU lacks refuses the kernels, "
             "with the reason); process-wide"),
    Variable("METRALE_OPENBLAS", "kernels.openblas", "(search)", "path of libopenblas.so.0 to preload before "
             "mlx, or none; process-wide, read when mlx is first imported"),
    Variable("METRALE_ATTENTION_THREADS", "kernels.attention_threads", "(CPUs)", "threads of the CPU kernels; "
             "process-wide, applied when the extension loads"),
    Variable("METRALE_SPIN_US", "kernels.spin_us", "50", "microseconds an idle kernel thread spins before it "
             "sleeps (0: never); process-wide, applied when the extension loads"),
    Variable("METRALE_FAILPOINTS", "failpoints", "(none)", "faults to inject, e.g. detokenize=0.01,execute=@id "
             "(metrale/failpoints.py); EngineConfig.failpoints wins"),
    Variable("METRALE_TP_STEP_TIMEOUT_S", "tp_step_timeout_s", "120", "seconds a tensor-parallel step may run "
             "before the group is declared dead"),
    Variable("METRALE_ENGINE_HANG_TIMEOUT_S", "engine_hang_timeout_s", "300", "seconds an engine process may "
             "send no heartbeat, or run one step (and 50 times its mean step), before it is killed and restarted, "
             "failing the requests in flight (at least 1)"),
    Variable("METRALE_LOG_LEVEL", "log_level", "INFO", "log level of the tensor-parallel follower ranks "
             "(the engine process logs at the server's `--log-level`, handed to it on its command line)"),
    Variable("METRALE_API_KEY", "api_key", "(none)", "the server's bearer token when --api-key is not given"),
)


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Everything besides EngineConfig that decides how this process runs (see `ENVIRONMENT`)."""

    kernels: KernelSettings = field(default_factory=KernelSettings)
    failpoints: str = ""
    tp_step_timeout_s: float = 120.0
    engine_hang_timeout_s: float = 300.0
    log_level: str = "INFO"
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.failpoints, str):
            raise ValueError(f"failpoints must be a string, got {self.failpoints!r}")
        if not self.tp_step_timeout_s > 0:
            raise ValueError(f"METRALE_TP_STEP_TIMEOUT_S must be > 0, got {self.tp_step_timeout_s!r}")
        if not self.engine_hang_timeout_s >= MIN_ENGINE_HANG_TIMEOUT_S:  # the child beats twice a second
            raise ValueError(f"METRALE_ENGINE_HANG_TIMEOUT_S must be >= {MIN_ENGINE_HANG_TIMEOUT_S:g}, "
                             f"got {self.engine_hang_timeout_s!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"METRALE_LOG_LEVEL={self.log_level!r}: expected one of {', '.join(LOG_LEVELS)}")

    @classmethod
    def resolve(cls, config: EngineConfig | None = None, environ: Mapping[str, str] | None = None, *,
                api_key: str | None = None) -> "RuntimeSettings":
        """The settings of a process: `config` and flags (`api_key`) first, then the environment
        (default os.environ), then the defaults. ValueError names a variable whose value is not allowed."""
        env = os.environ if environ is None else environ
        failpoints = config.failpoints if config is not None and config.failpoints is not None \
            else env.get("METRALE_FAILPOINTS", "")
        timeout_s = environ_number(env, "METRALE_TP_STEP_TIMEOUT_S", float)
        hang_timeout_s = environ_number(env, "METRALE_ENGINE_HANG_TIMEOUT_S", float)
        return cls(kernels=KernelSettings.from_environ(env), failpoints=failpoints,
                   tp_step_timeout_s=120.0 if timeout_s is None else timeout_s,
                   engine_hang_timeout_s=300.0 if hang_timeout_s is None else hang_timeout_s,
                   log_level=(env.get("METRALE_LOG_LEVEL") or "INFO").upper(),
                   api_key=api_key or env.get("METRALE_API_KEY") or None)

    def replace(self, **changes: object) -> "RuntimeSettings":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

