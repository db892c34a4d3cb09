"""The text front-end of the engine, on the event-loop thread: the way in and the way out.

    InputProcessor   prompt text / token ids / chat messages  ->  validated prompt token ids
    OutputProcessor  makes each request's RequestText         :   new token ids  ->  text deltas
                     (incremental detokenizer, then stop strings with their ambiguous tail held back)

Bad input raises one of metrale.errors' typed rejections and changes nothing. Never imports mlx.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from metrale.errors import (EmptyPromptError, InvalidMessagesError, InvalidPromptError, InvalidTokenIdError,
                            PromptTooLongError)
from metrale.failpoints import NO_FAILPOINTS, Failpoints
from metrale.sampling_params import SamplingParams
from metrale.text.chat_template import ChatTemplate
from metrale.text.detokenizer import IncrementalDetokenizer
from metrale.text.stop import StopStringMatcher, compile_stops
from metrale.text.tokenizer import Tokenizer

__all__ = ["InputProcessor", "OutputProcessor", "RequestText", "bad_words_token_ids"]
BAD_WORDS_CACHE_SIZE = 64  # distinct bad-word lists kept tokenized


class InputProcessor:
    """Encodes and validates what a request brings; `vocab_size` is the model's (its logits' width).

    A text longer than `max_model_len` times the longest vocabulary entry cannot fit in the context
    whatever its tokens: it is refused before tokenizing (tokenizing megabytes takes seconds).
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate, vocab_size: int, *,
                 max_model_len: int | None = None, failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        longest_token = max((len(token) for token in tokenizer.backend.get_vocab()), default=1)
        self.max_prompt_chars = None if max_model_len is None else max_model_len * max(1, longest_token)
        self._failpoints = failpoints
        self._bad_words_cache: OrderedDict[tuple[str, ...], tuple[tuple[int, ...], ...]] = OrderedDict()
        self._cache_lock = threading.Lock()  # the event loop and the tokenize thread both use the cache

    def check_length(self, text: str) -> None:
        """PromptTooLongError when `text` is certainly longer than the context, before tokenizing."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"prompt of {len(text)} characters cannot fit in max_model_len tokens (at most "
                f"{self.max_prompt_chars} characters for this vocabulary)")

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A text prompt encoded (with the special tokens the model adds), or token ids checked."""
        if isinstance(prompt, str):
            self._failpoints.check("tokenize")
            self.check_length(prompt)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Sequence) and all(type(t) is int for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidTokenIdError(f"prompt token ids must be in [0, {self.vocab_size}), got {bad[:5]}")
        else:
            raise InvalidPromptError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise EmptyPromptError("prompt is empty")
        return ids

    def params(self, params: SamplingParams) -> SamplingParams:
        """The params to run with: token ids checked against the vocabulary (InvalidTokenIdError naming
        the field), and each bad word's token sequences added to bad_words_token_ids."""
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for seq in params.bad_words_token_ids for t in seq])):
            bad = sorted({t for t in ids if t >= self.vocab_size})
            if bad:
                raise InvalidTokenIdError(f"{name} token ids must be in [0, {self.vocab_size}), got {bad[:5]}",
                                          field=name)
        if not params.bad_words:
            return params
        sequences = self.bad_words_ids(params.bad_words)
        return msgspec.structs.replace(params, bad_words_token_ids=params.bad_words_token_ids + sequences)

    def bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """bad_words_token_ids of `words`, from a small cache (`prepare` fills it off the event loop)."""
        with self._cache_lock:
            cached = self._bad_words_cache.get(words)
            if cached is not None:
                self._bad_words_cache.move_to_end(words)
                return cached
        sequences = tuple(bad_words_token_ids(self.tokenizer, words))
        with self._cache_lock:
            self._bad_words_cache[words] = sequences
            while len(self._bad_words_cache) > BAD_WORDS_CACHE_SIZE:
                self._bad_words_cache.popitem(last=False)
        return sequences

    def prepare(self, params: SamplingParams) -> None:
        """Do on this (worker) thread what submitting `params` would do on the caller's: tokenize the bad
        words and compile the stop strings, into their caches. Bounded by SamplingParams' limits."""
        if params.bad_words:
            self.bad_words_ids(params.bad_words)
        if params.stop_strings:
            compile_stops(params.stop_strings)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                 **template_kwargs: Any) -> list[int]:
        """The model's chat template over `messages` (with the generation prompt, and `tools` given to the
        template as Hugging Face passes them), encoded."""
        self._failpoints.check("tokenize")
        try:
            prompt = self.chat_template.render(messages, add_generation_prompt=True, tools=tools, **template_kwargs)
        except ValueError as error:  # bad roles or content, or the template's raise_exception
            raise InvalidMessagesError(str(error)) from error
        self.check_length(prompt)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise EmptyPromptError("the chat template rendered an empty prompt")
        return ids


class OutputProcessor:
    """Makes the per-request text state; holds the tokenizer the detokenizers decode with."""

    def __init__(self, tokenizer: Tokenizer, failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self.tokenizer = tokenizer
        self._failpoints = failpoints

    def new_request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                    request_id: str | None = None) -> "RequestText":
        return RequestText(
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens),
            StopStringMatcher(params.stop_strings, params.include_stop_str_in_output) if params.stop_strings else None,
            request_id, self._failpoints)


class RequestText:
    """One request's token ids -> text: detokenize, then match stop strings.

    A request that ends holds back no text except an incomplete UTF-8 character at the very end (a
    length cut inside a multi-byte character): that tail is dropped, never shown as U+FFFD; its token
    ids are in the output all the same.
    """

    __slots__ = ("_detokenizer", "_stop_matcher", "_request_id", "_failpoints")

    def __init__(self, detokenizer: IncrementalDetokenizer, stop_matcher: StopStringMatcher | None,
                 request_id: str | None = None, failpoints: Failpoints = NO_FAILPOINTS) -> None:
        self._detokenizer = detokenizer
        self._stop_matcher = stop_matcher
        self._request_id = request_id
        self._failpoints = failpoints

    @property
    def has_stop_strings(self) -> bool:
        """True when the request has stop strings to match."""
        return self._stop_matcher is not None

    def push(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Text of new ids, and whether a stop string matched (text after it is dropped). With
        `final` (the request ends with these ids) everything held back is released."""
        self._failpoints.check("detokenize", self._request_id)
        text = self._detokenizer.push(token_ids) if token_ids else ""
        if final:
            text += self._detokenizer.flush(drop_incomplete=True)
        if self._stop_matcher is None:
            return text, False
        self._failpoints.check("stop_match", self._request_id)
        text, matched = self._stop_matcher.feed(text)
        if final and not matched:
            text += self._stop_matcher.flush()
            matched = self._stop_matcher.matched
        return text, matched

    def flush(self) -> str:
        """Text still held back, for a request that ends without new tokens (error)."""
        text = self._detokenizer.flush(drop_incomplete=True)
        if self._stop_matcher is not None:
            text = self._stop_matcher.feed(text)[0] + self._stop_matcher.flush()
        return text


def bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[tuple[int, ...]]:
    """Each bad word's token ids as generated at the start of the text and after a space (vLLM's rule:
    the spaced form is kept when it is a different sequence of the same length)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if plain:
            sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
