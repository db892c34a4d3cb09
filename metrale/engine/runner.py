"""ModelRunner: turns one SchedulerOutput into one batched forward and sampled tokens.

Runs only on the MLX thread. Plain Python comes in (the scheduler's output and the sampling rows),
plain Python goes out (one token id per sampling request):

    SchedulerOutput --AttentionMetadata.build--> token_ids (T,) positions (T,) slot_mapping (T,) ...
        model(token_ids, positions, kv_cache, metadata) -> hidden (T, D)
        pooler.plan(hidden, ...)         embedding requests' rows pooled (metrale.engine.pooling), never sampled
        logits = model.compute_logits(hidden[sample_index])                     (S', V)
        mx.async_eval(logits, pools)     the forward and this step's K/V writes start together
        constraints.prepare(rows)        meanwhile on the host: grammar / allowed-token bitmask
        sampler.sample(logits, batch)    -> S' token ids (a second, small evaluation and one .tolist())
        constraints.accept(...)          grammars take their sampled tokens

It owns the model, the KV pools, the sampler and the per-request token constraints (grammar matchers,
dropped when StepInput.finished_request_ids names their request), nothing of the text front-end.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from kernels.backend import Backends, select_backends
from kernels.runtime import mx
from kernels.settings import KernelSettings
from kvcache.storage import PagedKVCache
from metrale.config import EngineConfig
from metrale.engine.lora_slots import LoraSlots
from metrale.engine.pooling import Pooler, PoolingRow
from metrale.engine.step import ForwardInput, PromptLogprobs, RowError, RowResult
from metrale.failpoints import NO_FAILPOINTS, Failpoints
from metrale.loading import LoadedModel, load_model
from metrale.models.lora_spec import lora_targets
from metrale.outputs import TokenLogprob
from metrale.sampling.constraints import TokenConstraints
from metrale.sampling.guided import GrammarCompiler
from metrale.sampling.prompt_logprobs import PromptRows
from metrale.sampling.sampler import Sampler
from metrale.sampling_params import SamplingParams
from metrale.speculative.draft_model import DraftModelProposer
from metrale.speculative.proposers import DraftRequest, RunnerProposer
from metrale.speculative.verify import accepted_runs
from scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:  # a one-rank engine never imports metrale.distributed
    from metrale.distributed.group import TensorParallelGroup

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
class PromptLogprobsRow:
    """A request whose prompt chunk this step returns prompt logprobs (SamplingParams.prompt_logprobs)."""

    request_id: str
    num_logprobs: int  # top alternatives per position
    prompt_token_ids: Sequence[int]  # the targets: logits at position p score prompt[p + 1]


@dataclass(frozen=True, slots=True)
class StepInput:
    """One step for the runner.

    sampling_rows: the requests that sample one token (in scheduled order; speculating ones are
        verified instead). draft_contexts: the known tokens of the requests whose drafts the
        runner's proposer makes. finished_request_ids: requests that ended since the previous step
        (the runner forgets what it kept for them).
    """

    scheduler_output: SchedulerOutput
    sampling_rows: tuple[SamplingRow, ...]
    draft_contexts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    finished_request_ids: tuple[str, ...] = ()
    prompt_logprobs: tuple[PromptLogprobsRow, ...] = ()  # only requests that asked; no other row is computed
    pooling_rows: tuple[PoolingRow, ...] = ()  # embedding requests: pooled, never sampled (metrale.engine.pooling)

    def for_group(self, group: tuple[ScheduledRequest, ...]) -> "StepInput":
        """The same step restricted to `group` (a sub-batch when a failed step is split)."""
        ids = {s.request_id for s in group}
        held = {block for s in group for block in s.block_table}
        copies = tuple(c for c in self.scheduler_output.block_copies if c[1] in held)  # a fork's copy goes with it
        sub = SchedulerOutput(group, sum(s.num_tokens for s in group), (), self.scheduler_output.block_size, copies)
        return StepInput(sub, tuple(r for r in self.sampling_rows if r.request_id in ids),
                         {rid: ctx for rid, ctx in self.draft_contexts.items() if rid in ids},
                         self.finished_request_ids, tuple(r for r in self.prompt_logprobs if r.request_id in ids),
                         tuple(r for r in self.pooling_rows if r.request_id in ids))


def _bytes_per_block(loaded: LoadedModel, block_size: int, kv_dtype: mx.Dtype) -> int:
    mc = loaded.config
    return PagedKVCache.bytes_per_block(mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim,
                                        kv_dtype)


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """ValueError unless the draft model speaks the target's tokenizer (same vocabulary and ids)."""
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the "
                         f"target's ({target.config.vocab_size})")
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the target's: drafts would be other tokens")


def resolve_dtype(name: str) -> mx.Dtype:
    """Activations and KV dtype: "auto" is float32 on CPU and float16 on GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return _DTYPES[name]


_KV_DTYPES = {**_DTYPES, "int8": mx.int8}  # int8: q8 rows (kvcache/quantized.py)


def resolve_kv_dtype(name: str, activations: mx.Dtype) -> mx.Dtype:
    """The KV pools' dtype: "auto" is float16 on CPU when the activations are float32, else the
    activations' dtype (GPU unchanged). On CPU the kernels read the 16-bit pools directly; on the default
    model its first-step logits stay within 0.05 of a float32 cache's (measured <= 0.013) with the same
    greedy tokens (tests/metrale/engine/test_kv_cache_dtype.py)."""
    if name != "auto":
        return _KV_DTYPES[name]
    if mx.default_device() == mx.cpu and activations == mx.float32:
        return mx.float16
    return activations


def weights_dtype(name: str) -> mx.Dtype | None:
    """What `load_model` gets: None ("auto" on CPU) keeps a quantized checkpoint quantized for the
    CPU kernels; an explicit dtype dequantizes to it."""
    if name == "auto" and mx.default_device() == mx.cpu:
        return None
    return resolve_dtype(name)


class ModelRunner:
    """Owns the model, the KV pools and the sampler; executes steps."""

    def __init__(self, loaded: LoadedModel, kv_cache: PagedKVCache, seed: int, backends: Backends,
                 failpoints: Failpoints = NO_FAILPOINTS, drafter: RunnerProposer | None = None,
                 grammar_compiler: GrammarCompiler | None = None, group: TensorParallelGroup | None = None,
                 lora: LoraSlots | None = None, *, pooling: str = "last") -> None:
        """`group`: rank 0's tensor-parallel group when the model is sharded (every step is sent to
        the other ranks, which run the same forward; only this rank samples). `lora`: the resident LoRA
        adapters, when the model's family has LoRA support (None: a request with an adapter fails).
        `pooling`: how embedding requests are pooled (EngineConfig.pooling)."""
        self.model = loaded.model
        self.model_config = loaded.config
        self.model_name = loaded.path.stem
        self.load_seconds = loaded.load_seconds
        self.kv_cache = kv_cache
        self.backends = backends  # decided once, at load
        self.dtype_name = str(loaded.dtype).removeprefix("mlx.core.")
        self.sampler = Sampler(self.model_config.vocab_size, eos_token_ids=loaded.tokenizer.eos_token_ids, seed=seed,
                               backend=backends.activations)
        self.failpoints = failpoints
        self.drafter = drafter  # the runner-side proposer, when speculation uses a draft model
        self.grammar_compiler = grammar_compiler  # shared with the engine, which compiles ahead of submit
        self.constraints = TokenConstraints(self.model_config.vocab_size, grammar_compiler)
        self.group = group
        self.lora = lora
        self.pooler = Pooler(pooling)

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, config: EngineConfig, failpoints: Failpoints = NO_FAILPOINTS,
                    group: TensorParallelGroup | None = None, *,
                    settings: KernelSettings | None = None) -> "ModelRunner":
        """Allocate the KV pools from the budget and choose the kernels for a loaded model (and load
        the draft model, whose pools share the budget, when speculation uses one). With a
        tensor-parallel `group` the model holds this rank's share: its pools hold its kv heads only,
        and the budget is per rank."""
        if (group.size if group is not None else 1) != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} needs the model sharded over a group "
                             f"of that size (AsyncEngine starts one); got {group.size if group else 'no group'}")
        mc = loaded.config
        kv_heads = mc.num_key_value_heads // config.tensor_parallel_size
        spec = config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_model(spec.model, dtype=weights_dtype(config.dtype))
            check_draft_model(loaded, draft)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, loaded.dtype)
        draft_per_block = _bytes_per_block(draft, config.block_size, kv_dtype) if draft is not None else 0
        kv_cache = PagedKVCache.from_budget(config.kv_cache_bytes, mc.num_hidden_layers, config.block_size, kv_heads,
                                            mc.head_dim, kv_dtype, shared_bytes_per_block=draft_per_block)
        backends = select_backends(settings)  # None: the settings in force (kernels.settings.current)
        logger.info("%s, %s; %s", loaded.path.name, loaded.describe_quantization(), backends.describe())
        drafter = None
        if draft is not None:
            dc = draft.config
            draft_cache = PagedKVCache(dc.num_hidden_layers, kv_cache.num_blocks, config.block_size, dc.num_key_value_heads,
                                       dc.head_dim, kv_dtype)
            drafter = DraftModelProposer(draft.model, draft_cache, backends.attention)
            logger.info("speculating with draft model %s (%d layers)", draft.path.name, dc.num_hidden_layers)
        lora = None
        if group is None and lora_targets(mc):  # no LoRA under tensor parallelism (the bank is not sharded)
            lora = LoraSlots(loaded.model, mc, config.max_loras, config.max_lora_rank, loaded.dtype)
        return cls(loaded, kv_cache, config.seed, backends, failpoints, drafter, grammar_compiler_for(loaded), group,
                   lora, pooling=config.pooling)

    @classmethod
    def load(cls, config: EngineConfig) -> "ModelRunner":
        """Load the model of `config` and build its runner (tests and benchmarks; the engine keeps the
        LoadedModel's tokenizer for its text front-end and calls `from_loaded`)."""
        return cls.from_loaded(load_model(config.model, dtype=weights_dtype(config.dtype)), config)

    def execute(self, step: StepInput) -> list[RowResult]:
        """One forward over every scheduled token (drafts included); samples where a request reaches
        its end, verifies where it speculates. Under tensor parallelism the other ranks run the same
        forward (metrale.distributed) and a failure of the group raises TensorParallelError."""
        if self.group is not None:
            return self.group.run_step(self._execute, step)
        return self._execute(step)

    def _execute(self, step: StepInput) -> list[RowResult]:
        self.constraints.forget(step.finished_request_ids)
        self.pooler.forget(step.finished_request_ids)
        scheduled = step.scheduler_output.scheduled
        if self.failpoints:
            self.failpoints.check_any("execute", [s.request_id for s in scheduled])
        if self.drafter is not None and step.finished_request_ids:
            self.drafter.forget(step.finished_request_ids)
        self._copy_draft_blocks(step.scheduler_output.block_copies)
        drafts = self._drafts(step)  # request id -> its draft tokens
        forward = ForwardInput(
            token_ids=tuple(t for s in scheduled for t in (*s.token_ids, *drafts.get(s.request_id, ()))),
            query_lens=tuple(s.num_tokens for s in scheduled),
            context_lens=tuple(s.start_position + s.num_tokens for s in scheduled),
            block_tables=tuple(s.block_table for s in scheduled),
            block_size=self.kv_cache.block_size,
            block_copies=tuple(step.scheduler_output.block_copies))
        if self.group is not None:
            self.group.send_forward(forward)  # the other ranks run it with this one
        with self._lora_step(step):
            hidden = forward.run(self.model, self.kv_cache, self.backends.attention)  # (T, D)
        pooled = self.pooler.plan(hidden, scheduled, step.pooling_rows)  # embedding requests' rows, never sampled
        pooling_ids = {r.request_id for r in step.pooling_rows}
        sample_rows, verify_rows, row = [], [], 0
        for s in scheduled:
            row += s.num_tokens
            if s.num_draft_tokens:  # the last known token's row and each draft's
                verify_rows.extend(range(row - s.num_draft_tokens - 1, row))
            elif s.samples and s.request_id not in pooling_ids:
                sample_rows.append(row - 1)
        prompt = PromptRows.plan(scheduled, step.prompt_logprobs)
        if not sample_rows and not verify_rows and not prompt.rows:  # prompt chunks only: fill the pools, pool
            mx.eval(self._pools(), pooled.arrays)
            self._forward_launched()
            return pooled.commit()
        num_sampled = len(sample_rows) + len(verify_rows)
        rows = mx.array(sample_rows + verify_rows + prompt.rows, dtype=mx.int32)
        logits = self.model.compute_logits(hidden[rows])  # (S' + sum(k + 1) + prompt rows, V)
        mx.async_eval(logits, self._pools(), pooled.arrays)  # the forward, this step's K/V writes and pooling
        self._forward_launched()
        prompt_logprobs = prompt.logprobs(logits[num_sampled:]) if prompt.rows else {}
        rows: list[RowResult] = []
        if sample_rows:
            rows += self._sample(step, logits[:len(sample_rows)] if len(sample_rows) < logits.shape[0] else logits,
                                 prompt_logprobs)
        if verify_rows:
            speculating = [s for s in scheduled if s.num_draft_tokens]
            runs = accepted_runs(logits[len(sample_rows):num_sampled], [drafts[s.request_id] for s in speculating])
            rows += [RowResult(s.request_id, tuple(run)) for s, run in zip(speculating, runs)]
        rows += [RowResult(request_id, prompt_logprobs=PromptLogprobs(first, logprobs))
                 for request_id, (first, logprobs) in prompt_logprobs.items()]  # prompt chunks that sample nothing
        return rows + pooled.commit()

    def _sample(self, step: StepInput, logits: mx.array,
                prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]]) -> list[RowResult]:
        """One token per sampling row from its logits (S', V), through its constraint; the rows of
        requests whose last prompt chunk also scored prompt logprobs take them (popped)."""
        masks = self.constraints.prepare(step.sampling_rows)  # host work while the forward runs
        if self.failpoints:
            for sampling_row in step.sampling_rows:
                self.failpoints.check("sample", sampling_row.request_id)
        batch = self.sampler.prepare(step.sampling_rows, masks.bitmask)
        output = self.sampler.sample(logits, batch)
        outcome = self.constraints.accept(step.sampling_rows, output.token_ids, masks)
        rows = []
        for sampling_row, token_id, logprob in zip(step.sampling_rows, output.token_ids, output.logprobs):
            request_id = sampling_row.request_id
            error = outcome.errors.get(request_id)
            prompt = prompt_logprobs.pop(request_id, None)
            rows.append(RowResult(request_id, (token_id,), logprob,
                                  PromptLogprobs(*prompt) if prompt is not None else None,
                                  request_id in outcome.finished, RowError.of(error) if error is not None else None))
        return rows

    def _lora_step(self, step: StepInput):
        """Each token's LoRA slot set on the model while the forward's graph is built (metrale.engine.lora_slots)."""
        scheduled = step.scheduler_output.scheduled
        if self.lora is None:
            if any(s.lora is not None for s in scheduled):
                raise ValueError(f"this model ({self.model_config.architecture}) runs no LoRA adapters")
            return contextlib.nullcontext()
        self.lora.forget((*step.finished_request_ids, *step.scheduler_output.preempted_request_ids))
        return self.lora.step(scheduled)

    def close(self) -> None:
        """Stop the grammar compiler's thread (the engine calls this at shutdown)."""
        if self.grammar_compiler is not None:
            self.grammar_compiler.shutdown()

    def _copy_draft_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """The draft model's copies of forked requests' partial blocks (the target's pools copy theirs in
        ForwardInput.run, on every rank). Safe to repeat (a retried step): the child rewrites only
        positions after those its parent had computed."""
        if copies and self.drafter is not None:
            self.drafter.copy_blocks(copies)

    def _drafts(self, step: StepInput) -> dict[str, tuple[int, ...]]:
        """The drafts of every speculating request: given by the scheduler, or proposed here."""
        drafts = {}
        asks = []
        for s in step.scheduler_output.scheduled:
            if s.draft_token_ids:
                drafts[s.request_id] = s.draft_token_ids
            elif s.num_draft_tokens:
                asks.append(DraftRequest(s.request_id, step.draft_contexts[s.request_id], s.block_table,
                                         s.num_draft_tokens))
        if asks:
            if self.drafter is None:
                raise RuntimeError(f"{len(asks)} requests want drafts from the runner, which has no draft model")
            drafts.update((rid, tuple(d)) for rid, d in self.drafter.propose(asks).items())
        return drafts

    def _forward_launched(self) -> None:
        if self.group is not None:
            self.group.forward_launched()

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
