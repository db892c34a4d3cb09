"""ModelRunner: turns one SchedulerOutput into one batched forward and sampled tokens.

Runs only on the MLX thread. Plain Python comes in (the scheduler's output and the sampling rows),
plain Python goes out (one token id per sampling request):

    SchedulerOutput --AttentionMetadata.build--> token_ids (T,) positions (T,) slot_mapping (T,) ...
        model(token_ids, positions, kv_cache, metadata) -> hidden (T, D)
        logits = model.compute_logits(hidden[sample_index])                     (S', V)
        sampler.sample(logits, batch) -> S' token ids, one evaluation, one .tolist()
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from kernels.backend import select_backends
from kernels.runtime import mx

from kvcache.attention import AttentionMetadata
from kvcache.storage import PagedKVCache
from metrale.text.chat_template import ChatTemplate, default_builtin
from metrale.config import EngineConfig
from metrale.loading import LoadedModel, load_model
from metrale.text.detokenizer import IncrementalDetokenizer
from metrale.outputs import TokenLogprob
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


@dataclass(frozen=True, slots=True)
class StepResult:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprob] | None = None


def resolve_dtype(name: str) -> mx.Dtype:
    """"auto" is float32 on CPU (fast with OpenBLAS) and float16 on GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return _DTYPES[name]


def chat_template_for(loaded: LoadedModel) -> ChatTemplate:
    """The model's own chat template, or the built-in that fits its architecture."""
    tok = loaded.tokenizer
    bos = tok.bos_token or ""
    eos = tok.eos_tokens[0] if tok.eos_tokens else ""
    if tok.chat_template:
        return ChatTemplate(tok.chat_template, bos_token=bos, eos_token=eos)
    name = default_builtin(loaded.config.architecture, tok.special_tokens)
    return ChatTemplate.builtin(name, bos_token=bos or None, eos_token=eos or None)


class ModelRunner:
    """Owns the model, the KV pools and the sampler; executes steps."""

    def __init__(self, loaded: LoadedModel, kv_cache: PagedKVCache, seed: int) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = chat_template_for(loaded)
        self.model_name = loaded.path.stem
        self.load_seconds = loaded.load_seconds
        self.kv_cache = kv_cache
        dtype = loaded.dtype
        self.dtype_name = str(dtype).removeprefix("mlx.core.")
        self.sampler = Sampler(self.model_config.vocab_size, eos_token_ids=self.tokenizer.eos_token_ids, seed=seed)

    @classmethod
    def load(cls, config: EngineConfig) -> "ModelRunner":
        """Load weights, tokenizer and chat template; allocate the KV pools from the budget."""
        auto_cpu = config.dtype == "auto" and mx.default_device() == mx.cpu  # keeps the checkpoint's quantization
        loaded = load_model(config.model, dtype=None if auto_cpu else resolve_dtype(config.dtype))
        logger.info("%s, %s; %s", loaded.path.name, loaded.describe_quantization(), select_backends().describe())
        mc = loaded.config
        kv_cache = PagedKVCache.from_budget(config.kv_cache_bytes, mc.num_hidden_layers, config.block_size,
                                            mc.num_key_value_heads, mc.head_dim, loaded.dtype)
        return cls(loaded, kv_cache, config.seed)

    def new_detokenizer(self, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)

    def execute(self, step: StepInput) -> StepResult:
        """One forward over every scheduled token; samples where a request reaches its end."""
        scheduled = step.scheduler_output.scheduled
        metadata = AttentionMetadata.build(
            [len(s.token_ids) for s in scheduled],
            [s.start_position + len(s.token_ids) for s in scheduled],
            [s.block_table for s in scheduled],
            self.kv_cache.block_size)
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
        mx.eval(logits, self._pools())  # the forward and this step's K/V writes, in one evaluation
        output = self.sampler.sample(logits, self.sampler.prepare(step.sampling_rows))
        ids = [r.request_id for r in step.sampling_rows]
        sampled = dict(zip(ids, output.token_ids))
        logprobs = {i: lp for i, lp in zip(ids, output.logprobs) if lp is not None} or None
        return StepResult(sampled, logprobs)

    def _pools(self) -> list[mx.array]:
        return [pool for layer in range(self.kv_cache.num_layers) for pool in self.kv_cache.layer(layer)]
