"""ModelRunner: turns one SchedulerOutput into one batched forward and sampled tokens.

Runs only on the MLX thread. Plain Python comes in (the scheduler's output and the sampling rows),
plain Python goes out (one token id per sampling request):

    SchedulerOutput --AttentionMetadata.build--> token_ids (T,) positions (T,) slot_mapping (T,) ...
        model(token_ids, positions, kv_cache, metadata) -> hidden (T, D)
        logits = model.compute_logits(hidden[sample_index])                     (S', V)
        mx.async_eval(logits, pools)     the forward and this step's K/V writes start together
        constraints.prepare(rows)        meanwhile on the host: grammar / allowed-token bitmask
        sampler.sample(logits, batch)    -> S' token ids (a second, small evaluation and one .tolist())
        constraints.accept(...)          grammars take their sampled tokens

It owns the model, the KV pools, the sampler and the per-request token constraints (grammar matchers,
dropped when StepInput.finished_request_ids names their request), nothing of the text front-end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from kernels.backend import Backends, select_backends
from kernels.runtime import mx
from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache
from metrale.config import EngineConfig
from metrale.loading import LoadedModel, load_model
from metrale.outputs import TokenLogprob
from metrale.sampling.constraints import TokenConstraints
from metrale.sampling.guided import GrammarCompiler
from metrale.sampling.sampler import Sampler
from metrale.sampling_params import SamplingParams
from scheduler import SchedulerOutput

logger = logging.getLogger(__name__)
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One request that samples a token this step (in scheduled order)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # its length is the output position of the token sampled now


@dataclass(frozen=True, slots=True)
class StepInput:
    scheduler_output: SchedulerOutput
    sampling_rows: tuple[SamplingRow, ...]
    finished_request_ids: tuple[str, ...] = ()  # ended since the last step: drop their per-request state


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] | None = None
    # Their constraint is complete (the grammar allows only eos now): they end with "stop" after this token.
    stopped_request_ids: frozenset[str] = frozenset()
    # Requests this step could not serve (e.g. their grammar failed to compile): they end with an error.
    failed_requests: dict[str, BaseException] | None = None


def resolve_dtype(name: str) -> mx.Dtype:
    """"auto" is float32 on CPU (fast with OpenBLAS) and float16 on GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return _DTYPES[name]


class ModelRunner:
    """Owns the model, the KV pools and the sampler; executes steps."""

    def __init__(self, loaded: LoadedModel, kv_cache: PagedKVCache, seed: int, backends: Backends,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.model_name = loaded.path.stem
        self.load_seconds = loaded.load_seconds
        self.kv_cache = kv_cache
        self.backends = backends  # decided once, at load
        self.dtype_name = str(loaded.dtype).removeprefix("mlx.core.")
        self.sampler = Sampler(self.model_config.vocab_size, eos_token_ids=loaded.tokenizer.eos_token_ids, seed=seed)
        self.grammar_compiler = grammar_compiler  # shared with the engine, which compiles ahead of submit
        self.constraints = TokenConstraints(self.model_config.vocab_size, grammar_compiler)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig) -> "ModelRunner":
        """Allocate the KV pools from the budget and choose the kernels for a loaded model."""
        mc = loaded.config
        kv_cache = PagedKVCache.from_budget(config.kv_cache_bytes, mc.num_hidden_layers, config.block_size,
                                            mc.num_key_value_heads, mc.head_dim, loaded.dtype)
        backends = select_backends()
        logger.info("kernels: %s", backends.describe())
        return cls(loaded, kv_cache, config.seed, backends, grammar_compiler_for(loaded))

    @classmethod
    def load(cls, config: EngineConfig) -> "ModelRunner":
        """Load the model of `config` and build its runner (tests and benchmarks; the engine keeps the
        LoadedModel's tokenizer for its text front-end and calls `from_loaded`)."""
        return cls.from_loaded(load_model(config.model, dtype=resolve_dtype(config.dtype)), config)

    def execute(self, step: StepInput) -> StepResult:
        """One forward over every scheduled token; samples where a request reaches its end."""
        self.constraints.forget(step.finished_request_ids)
        scheduled = step.scheduler_output.scheduled
        metadata = AttentionMetadata.build(
            [len(s.token_ids) for s in scheduled],
            [s.start_position + len(s.token_ids) for s in scheduled],
            [s.block_table for s in scheduled],
            self.kv_cache.block_size,
            backend=self.backends.attention)
        token_ids = mx.array([t for s in scheduled for t in s.token_ids], dtype=mx.int32)  # (T,)
        hidden = self.model(token_ids, metadata.positions, self.kv_cache, metadata)  # (T, D)
        if not step.sampling_rows:  # only prompt chunks that sample nothing: just fill the pools
            mx.eval(self._pools())
            return StepResult({})
        sample_index, row = [], 0
        for s in scheduled:
            row += len(s.token_ids)
            if s.samples:
                sample_index.append(row - 1)
        logits = self.model.compute_logits(hidden[mx.array(sample_index, dtype=mx.int32)])  # (S', V)
        mx.async_eval(logits, self._pools())  # the forward and this step's K/V writes, in one evaluation
        masks = self.constraints.prepare(step.sampling_rows)  # host work while the forward runs
        batch = self.sampler.prepare(step.sampling_rows, masks.bitmask)
        output = self.sampler.sample(logits, batch)
        outcome = self.constraints.accept(step.sampling_rows, output.token_ids, masks)
        ids = [r.request_id for r in step.sampling_rows]
        sampled = dict(zip(ids, output.token_ids))
        logprobs = {i: lp for i, lp in zip(ids, output.logprobs) if lp is not None} or None
        return StepResult(sampled, logprobs, outcome.finished, outcome.errors or None)

    def close(self) -> None:
        """Stop the grammar compiler's thread (the engine calls this at shutdown)."""
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()

    def _pools(self) -> list[mx.array]:
        return [pool for layer in range(self.kv_cache.num_layers) for pool in self.kv_cache.layer(layer)]


def grammar_compiler_for(loaded: LoadedModel) -> GrammarCompiler | None:
    """The model's grammar compiler (llguidance is imported at its first compile, not here); None for a
    tokenizer without eos ids, whose grammars could never end."""
    tokenizer = loaded.tokenizer
    if not tokenizer.eos_token_ids:
        logger.warning("the tokenizer has no eos token ids: structured outputs are unavailable")
        return None
    return GrammarCompiler(tokenizer.backend.to_str, max(loaded.config.vocab_size, tokenizer.vocab_size),
                           tokenizer.eos_token_ids)
