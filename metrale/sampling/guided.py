"""Grammar-constrained decoding with llguidance: compile a request's constraint, then follow it token by token.

    StructuredOutputs --grammar_text--> llguidance grammar --GrammarCompiler (pool thread, cached)--> CompiledGrammar
    CompiledGrammar.new_matcher() -> GrammarMatcher, one per request, owned by the MLX thread:
        per step   fill_bitmask(mask, row)   the allowed next tokens, one bit per id, into an int32 row
                   accept(token)             the sampled token; False = the grammar refused it (terminal)
                   is_finished               nothing but eos may follow: the output is complete

llguidance (the `metrale[structured]` extra) is imported on first use only, so metrale runs without it;
a request that needs it then gets StructuredOutputUnavailableError (400) naming the extra.

Threads: compiling (grammar construction drops the GIL) runs on the compiler's own single-worker pool,
never on the event loop or the MLX thread, on a thread with a COMPILE_STACK_BYTES stack: llguidance
recurses once per link of a `$ref` or rule chain (~4 KiB each; an 8 MiB stack overflows, SIGSEGV, at
~2,500 links), and with 64 MiB the chains StructuredOutputs lets through (MAX_REFS, MAX_GRAMMAR_RULES)
use a tenth of it at most; the compiled template is read-only afterwards and only the
MLX thread copies it into per-request matchers. A matcher must never be used by two threads at once
(llguidance raises "Already borrowed"), so every matcher lives on the MLX thread.

Facts this relies on (llguidance 1.9): the mask allows the eos ids exactly when the grammar may end;
a matcher whose grammar is complete `is_stopped()` and allows only eos; an error state is permanent;
JSON whitespace is unbounded by default (a weak model can emit it forever), hence JSON_OPTIONS;
grammar_from_regex's \\d is Unicode, hence regex_to_lark(..., "dw").
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from metrale.errors import InvalidStructuredOutputError, StructuredOutputUnavailableError
from metrale.structured_outputs import StructuredOutputs

logger = logging.getLogger(__name__)

EXTRA_HINT = "structured outputs need llguidance: pip install 'metrale[structured]'"
# Whitespace between JSON tokens: compact, json.dumps style or pretty-printed (one newline and an
# indentation of up to 20) fit; endless whitespace, which a weak model can emit forever, does not.
JSON_OPTIONS = {"whitespace_pattern": r"(?:\n[ \t]{0,20}|[ \t]{0,2})"}
PARALLEL_FILL_MIN_ROWS = 8  # fill masks on llguidance's thread pool from this many rows (and >= 4 CPUs)
COMPILE_STACK_BYTES = 64 * 1024 * 1024  # virtual: only the pages a deep grammar touches are committed
# llguidance's own limits, written out (its defaults): a grammar past them is a 400 when it compiles, or
# ends its request with an error at the step that crosses one (max_items_in_row, step_*)
PARSER_LIMITS = {"max_items_in_row": 2000, "initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000,
                 "step_max_items": 50_000, "max_lexer_states": 250_000, "max_grammar_size": 500_000}
# What a cached compiled grammar holds, estimated from its constraint's text: a 362 KiB object schema
# took RSS up by ~37 MiB on average (~100 bytes per character); small ones hold little.
COMPILED_BYTES_PER_CHAR = 128
COMPILED_BASE_BYTES = 64 * 1024
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


def llguidance_available() -> bool:
    """True when the `metrale[structured]` extra (llguidance) is installed."""
    return importlib.util.find_spec("llguidance") is not None


def require_llguidance() -> None:
    """Raise StructuredOutputUnavailableError (a 400 naming the extra) when llguidance is missing."""
    if not llguidance_available():
        raise StructuredOutputUnavailableError(EXTRA_HINT)


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (not compiled yet). InvalidStructuredOutputError on bad input."""
    import llguidance
    from llguidance import LLMatcher

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = json.loads(spec.json) if kind == "json" else {"type": "object"}
            if schema is False:
                raise InvalidStructuredOutputError("structured_outputs.json: the schema false matches nothing")
            return LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_OPTIONS)
        if kind == "regex":
            return LLMatcher.grammar_from_lark("start: /" + llguidance.regex_to_lark(spec.regex, "dw") + "/")
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as error:
        if isinstance(error, InvalidStructuredOutputError):
            raise
        raise InvalidStructuredOutputError(f"structured_outputs.{kind}: {error}") from None


class GrammarMatcher:
    """One request's position in its grammar. Used by one thread at a time (the MLX thread)."""

    __slots__ = ("_matcher", "num_tokens")

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self.num_tokens = 0  # tokens accepted so far (the request's output tokens it has seen)

    def fill_bitmask(self, mask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into mask[row]: (W,) int32, bit t % 32 of word t // 32."""
        view = mask[row]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)  # checks the size; drops the GIL

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the grammar refuses it (the matcher stays in error)."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self.num_tokens += 1
        return ok

    def resync(self, token_ids: Sequence[int]) -> bool:
        """Restart and accept `token_ids` (the request's whole output so far); False if one is refused."""
        self._matcher.reset()
        self.num_tokens = 0
        return all(self.accept(t) for t in token_ids)

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding)."""
        ok = self._matcher.rollback(num_tokens)
        if ok:
            self.num_tokens -= num_tokens
        return ok

    @property
    def is_finished(self) -> bool:
        """The constraint is complete: nothing but eos may follow (also true in the error state)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher is in its error state ("" when it is not)."""
        return self._matcher.get_error()

    @property
    def raw(self) -> Any:
        """The llguidance.LLMatcher (for the parallel fill)."""
        return self._matcher


class CompiledGrammar:
    """A compiled constraint: a read-only template matcher that per-request matchers are copied from."""

    __slots__ = ("spec", "_template")

    def __init__(self, spec: StructuredOutputs, template: Any) -> None:
        self.spec = spec
        self._template = template

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy: ~10 us). Call from the MLX thread only."""
        return GrammarMatcher(self._template.deep_copy())


def estimated_bytes(spec: StructuredOutputs) -> int:
    """What `spec`'s compiled grammar holds in memory, roughly (the grammar cache's cost of it)."""
    kind = spec.kind
    if kind == "choice":
        chars = sum(len(c) + 3 for c in spec.choice or ())
    elif kind == "json_object":
        chars = 0
    else:
        chars = len(getattr(spec, kind))
    return COMPILED_BASE_BYTES + COMPILED_BYTES_PER_CHAR * chars


class GrammarCompiler:
    """Compiles constraints on its own thread, caching them by StructuredOutputs.key (LRU), within
    `cache_bytes` of compiled grammars (estimated_bytes) and `cache_size` entries.

    `tokenizer_json` returns the model's Hugging Face tokenizer.json text (called once, on the pool
    thread); `n_vocab` is the width of the masks (the logits' width, or the tokenizer's vocabulary
    when larger); `eos_token_ids` are the ids the masks allow when the grammar may end.
    """

    def __init__(self, tokenizer_json: Callable[[], str], n_vocab: int, eos_token_ids: Sequence[int], *,
                 cache_size: int = 256, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if not eos_token_ids:
            raise ValueError("GrammarCompiler needs at least one eos token id")
        self.n_vocab = n_vocab
        self.mask_words = (n_vocab + 31) // 32
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer_json = tokenizer_json
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        # key -> (future, estimated bytes); cache_used_bytes is the sum of the estimates
        self._cache: OrderedDict[tuple[str, Any], tuple[Future[CompiledGrammar], int]] = OrderedDict()
        self.cache_used_bytes = 0
        self._lock = threading.Lock()  # the event loop and the MLX thread both submit
        self._pool = _pool_with_stack(COMPILE_STACK_BYTES, "metrale-grammar")
        self._lltokenizer: Any = None  # built on the pool thread at the first compile
        self._executor: Any = None  # llguidance.LLExecutor for parallel mask fills, made on first use

    def submit(self, spec: StructuredOutputs) -> Future[CompiledGrammar]:
        """The (shared, cached) future of `spec`'s compiled grammar. Never blocks on the compile.

        Raises StructuredOutputUnavailableError when llguidance is missing; a constraint the engine
        cannot use fails the future with InvalidStructuredOutputError.
        """
        require_llguidance()
        key = spec.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None and not entry[0].cancelled():
                self._cache.move_to_end(key)
                return entry[0]
            if entry is not None:
                self._evict(key)
            future = self._pool.submit(self._compile, spec)
            cost = estimated_bytes(spec)
            self._cache[key] = (future, cost)
            self.cache_used_bytes += cost
            while len(self._cache) > 1 and (len(self._cache) > self._cache_size
                                            or self.cache_used_bytes > self._cache_bytes):
                self._evict(next(iter(self._cache)))  # the least recently used
            return future

    def _evict(self, key: tuple[str, Any]) -> None:
        _, cost = self._cache.pop(key)
        self.cache_used_bytes -= cost

    @property
    def num_cached(self) -> int:
        """Constraints in the cache (compiled, compiling or failed)."""
        return len(self._cache)

    async def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """Await `spec`'s compiled grammar (raises InvalidStructuredOutputError for a bad constraint).
        Cancelling the caller leaves the shared compile running for the others."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(spec)))

    def shutdown(self) -> None:
        """Stop the compile thread (queued compiles are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fill_bitmasks(self, pairs: Sequence[tuple[GrammarMatcher, int]], mask: np.ndarray) -> None:
        """Fill mask[row] for each (matcher, row): one by one for a few rows, on llguidance's thread
        pool for many (the fills drop the GIL). `mask` is (R, mask_words) int32, C-contiguous."""
        if len(pairs) >= PARALLEL_FILL_MIN_ROWS and (os.cpu_count() or 1) >= 4:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)))
            self._executor.unsafe_compute_mask_ptr([(m.raw, row) for m, row in pairs], mask.ctypes.data,
                                                   mask.shape[1] * 4, mask.shape[0])
            return
        for matcher, row in pairs:
            matcher.fill_bitmask(mask, row)

    # ---- the pool thread ----

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        from llguidance import LLMatcher

        from llguidance import LLParserLimits

        grammar = grammar_text(spec)
        template = LLMatcher(self._tokenizer(), grammar, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
        if template.is_error():
            raise InvalidStructuredOutputError(f"structured_outputs.{spec.kind}: {template.get_error()}")
        return CompiledGrammar(spec, template)

    def _tokenizer(self) -> Any:
        if self._lltokenizer is None:
            from llguidance import LLTokenizer

            # eos_token: every eos id (llguidance's own guess can be wrong, e.g. <|endoftext|> for SmolLM2)
            self._lltokenizer = LLTokenizer(self._tokenizer_json(), n_vocab=self.n_vocab,
                                            eos_token=list(self.eos_token_ids))
            logger.info("grammar tokenizer ready: %d tokens, eos %s", self.n_vocab, self.eos_token_ids)
        return self._lltokenizer


def _pool_with_stack(stack_bytes: int, name: str) -> ThreadPoolExecutor:
    """A one-thread pool whose thread has a `stack_bytes` stack (threading.stack_size applies to threads
    started while it is set: the pool's thread is started here, at once, and the size restored)."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    previous = threading.stack_size(stack_bytes)
    try:
        pool.submit(int).result()
    finally:
        threading.stack_size(previous)
    return pool
