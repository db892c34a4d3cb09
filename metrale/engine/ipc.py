"""What the front-end and an engine process say to each other: msgspec records, length-prefixed frames.

    front-end -> engine     Start (once), then Add | Abort | Finish | AbortAll | Compile
    engine -> front-end     Ready (once, or StartFailed), then Outputs (one per step, and after
                            requests end outside a step) | Compiled (the answer to a Compile) |
                            Heartbeat (every HEARTBEAT_INTERVAL_S: metrale.engine.hang_watch)

An Outputs frame carries the step's EngineOutputs (metrale.engine.step), the engine's counters
(CoreStats: what `stats()` reports) and the step's metric samples, which the front-end records into
its own registry (so /metrics stays one process's exposition). A frame is a 4-byte little-endian length
then a msgpack body; the pipe is private to the two processes.
"""

from __future__ import annotations

import struct
from typing import Union

import msgspec

from metrale.engine.metrics import FinishedRequestStats, IterationStats
from metrale.engine.step import EngineOutput, RowError
from metrale.pooling_params import PoolingParams
from metrale.sampling_params import SamplingParams
from metrale.speculative.speculator import Verification
from metrale.structured_outputs import StructuredOutputs
from scheduler import FinishReason, LoraRef

HEADER = struct.Struct("<I")  # body length
MAX_FRAME_BYTES = 1 << 30
HEARTBEAT_INTERVAL_S = 0.5


class TokenizerSpec(msgspec.Struct, frozen=True):
    """Enough to rebuild the model's Tokenizer in the front-end without reading the model file."""

    backend_json: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    pad_token_id: int | None


class ModelFacts(msgspec.Struct, frozen=True):
    """What the front-end needs to know of the loaded model and its engine."""

    model_name: str
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    dtype_name: str
    kv_blocks: int
    kv_slots: int
    has_grammar_compiler: bool
    num_hidden_layers: int = 0
    lora_targets: dict[str, tuple[int, int]] = msgspec.field(default_factory=dict)  # {}: no LoRA support
    hidden_size: int = 0  # the width of an embedding before any Matryoshka truncation


class CoreStats(msgspec.Struct, frozen=True, array_like=True):
    """The engine core's counters after a step."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0
    peak_kv_usage: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished: int = 0
    num_unfinished: int = 0
    integrity_error: str | None = None  # checked whenever the core goes idle


class MetricSamples(msgspec.Struct, array_like=True, omit_defaults=True):
    """Metric calls the engine process made since its last frame, replayed into the front-end's EngineMetrics."""

    iterations: list[IterationStats] = msgspec.field(default_factory=list)
    finished: list[FinishedRequestStats] = msgspec.field(default_factory=list)
    speculation: list[Verification] = msgspec.field(default_factory=list)
    gauges: tuple[int, int, float] | None = None


# ---- front-end -> engine ----

class Start(msgspec.Struct, tag=True, array_like=True):
    config: dict  # EngineConfig as builtins (metrale.engine.engine_process rebuilds it)


class Add(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    eos_token_ids: tuple[int, ...]
    max_tokens: int
    priority: int = 0
    lora: LoraRef | None = None
    pooling: PoolingParams | None = None  # an embedding request (metrale.engine.pooling)


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_id: str


class Finish(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    reason: FinishReason
    error: RowError | None = None


class AbortAll(msgspec.Struct, tag=True, array_like=True):
    pass


class Compile(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    spec: StructuredOutputs


# ---- engine -> front-end ----

class Ready(msgspec.Struct, tag=True, array_like=True):
    facts: ModelFacts
    tokenizer: TokenizerSpec
    max_model_len: int
    stats: CoreStats


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    kind: str
    message: str


class Outputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineOutput]
    stats: CoreStats
    metrics: MetricSamples | None = None


class Compiled(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    error: RowError | None = None


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """The engine process's event loop runs; the step in flight (if any) has run for `step_running_s`."""

    step_running_s: float | None = None
    mean_step_s: float = 0.0


ToEngine = Union[Start, Add, Abort, Finish, AbortAll, Compile]
ToFront = Union[Ready, StartFailed, Outputs, Compiled, Heartbeat]

_encoder = msgspec.msgpack.Encoder()
TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
TO_FRONT = msgspec.msgpack.Decoder(ToFront)


def frame(message: msgspec.Struct) -> bytes:
    """One message as a length-prefixed frame."""
    body = _encoder.encode(message)
    return HEADER.pack(len(body)) + body


def body_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return length
