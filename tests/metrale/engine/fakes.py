"""Fast doubles for the engine room: a runner with no model, a tokenizer of letters, a core to drive.

FakeRunner follows ModelRunner's contract (StepInput in, RowResults out, on the MLX thread) with a
rule instead of a model: the token sampled after a sequence is (its last token + 1) % vocab_size.
FakeTokenizer decodes token i as the letter chr(97 + i % 26), so texts are easy to predict.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from kvcache.manager import KVCacheManager
from metrale.engine.core import EngineCore
from metrale.engine.metrics import EngineMetrics
from metrale.engine.mlx_thread import MLXThread
from metrale.engine.runner import StepInput
from metrale.engine.step import RowResult
from metrale.engine.stream import RequestStream
from metrale.engine.streams import RequestStreams
from metrale.failpoints import NO_FAILPOINTS, Failpoints
from metrale.sampling_params import SamplingParams
from metrale.text.processor import OutputProcessor
from scheduler import Scheduler, SchedulerConfig

VOCAB = 64
EOS = 63


class FakeTokenizer:
    eos_token_ids = (EOS,)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids if not (skip_special_tokens and i == EOS))


@dataclass
class FakeRunner:
    """Samples (last token + 1) % VOCAB for every row; `before_step` may raise to fail a step."""

    vocab_size: int = VOCAB
    steps: list[StepInput] = field(default_factory=list)
    before_step: Callable[[StepInput], None] | None = None
    failpoints: Failpoints = field(default_factory=lambda: NO_FAILPOINTS)

    def execute(self, step: StepInput) -> list[RowResult]:
        self.steps.append(step)
        self.failpoints.check_any("execute", [s.request_id for s in step.scheduler_output.scheduled])
        if self.before_step is not None:
            self.before_step(step)
        rows = []
        for row in step.sampling_rows:
            self.failpoints.check("sample", row.request_id)
            last = row.output_token_ids[-1] if row.output_token_ids else row.prompt_token_ids[-1]
            rows.append(RowResult(row.request_id, ((last + 1) % self.vocab_size,)))
        return rows


class FakeEngine:
    """An EngineCore over a FakeRunner, with `submit` as AsyncEngine does it (no model, no text front-end
    besides the detokenizer and stop strings)."""

    def __init__(self, *, num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, max_model_len: int = 256, failpoints: str = "",
                 enable_prefix_caching: bool = True, runner: "FakeRunner | None" = None,
                 clock: Callable[[], float] | None = None, **scheduling) -> None:
        config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, block_size=block_size,
                                 enable_prefix_caching=enable_prefix_caching, **scheduling)
        kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        self.failpoints = Failpoints.from_spec(failpoints, seed=0)
        self.runner = runner if runner is not None else FakeRunner()
        self.runner.failpoints = self.failpoints
        self.metrics = EngineMetrics(CollectorRegistry(), model_name="fake")
        self.metrics.set_max_model_len(max_model_len)
        self.mlx = MLXThread()
        timing = {} if clock is None else {"clock": clock}
        self.core = EngineCore(Scheduler(config, kv), self.runner, self.mlx, self.metrics, self.failpoints, **timing)
        self.streams = RequestStreams(self.core.finish, self.failpoints)
        self.core.on_outputs = self.streams.process
        self.outputs = OutputProcessor(FakeTokenizer(), self.failpoints)

    def submit(self, request_id: str, prompt: Sequence[int], params: SamplingParams | None = None) -> RequestStream:
        params = params or SamplingParams(max_tokens=4)
        text = self.outputs.new_request(prompt, params, request_id)
        self.core.submit(request_id, list(prompt), params, eos_token_ids=(EOS,), max_tokens=params.max_tokens or 16)
        (channel,) = self.streams.open([request_id], [text], len(prompt))
        return RequestStream(channel, lambda rid: self.streams.channel(rid) is channel and self.core.abort(rid))

    def check_clean(self) -> None:
        """Every request ended, every block free, accounting consistent."""
        self.core.scheduler.check_integrity()
        kv = self.core.scheduler.kv_cache_manager
        assert self.core.num_unfinished == 0
        assert kv.num_free_blocks == kv.num_blocks

    def close(self) -> None:
        self.mlx.shutdown()
