"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding one token at a time breaks characters whose bytes span tokens (emoji, CJK, combining marks
in byte-level BPE; byte-fallback tokens in SentencePiece): the lossy decode shows U+FFFD until the
last byte arrives. The classic fix (vLLM's `detokenize_incrementally`, TGI, `tokenizers.DecodeStream`)
decodes a small window of recent tokens and holds text back while the window's text ends in U+FFFD:

    ids       ... | prefix window      | new tokens
                  ^ prefix_offset      ^ read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    emit new_text[len(prefix_text):] unless new_text ends with U+FFFD (an incomplete character)

Decoding the window from `prefix_offset` (not from the new token alone) keeps decoder context such as
SentencePiece's leading-space handling identical in both strings. Offsets only advance when the text
ends on a complete character, so every window starts on a character boundary and
``"".join(deltas) + flush() == decode(output_ids)``; the property tests check this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded with the output for context (vLLM uses 5 too)


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer: a batch decode of ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ...


class IncrementalDetokenizer:
    """Per-request detokenizer: `push(new_ids)` returns the new text; cheap to create (a few us).

    `prompt_token_ids` (optional): the last few prompt tokens are decoded as context, so tokenizers
    that drop a leading space when a sequence starts (SentencePiece) keep it on the first output
    token, as they would mid-sequence. The context is skipped when it does not end on a complete
    character. With byte-level BPE (the default model) the text is the same either way.
    """

    __slots__ = ("_tokenizer", "_skip_special_tokens", "_ids", "_read_offset", "_prefix_text",
                 "_parts", "_num_tokens", "_flushed")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-CONTEXT_TOKENS:])
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith(REPLACEMENT_CHAR):  # the prompt ends mid-character: no context
            context, prefix_text = [], ""
        # Only the window is kept: _ids[:_read_offset] is the prefix window, the rest is held back.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = prefix_text
        self._parts: list[str] = []
        self._num_tokens = 0
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenated deltas)."""
        return "".join(self._parts)

    @property
    def num_tokens(self) -> int:
        """Output tokens pushed so far."""
        return self._num_tokens

    def push(self, token_ids: Iterable[int]) -> str:
        """Add output tokens; return the text they complete ("" while a character is incomplete)."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the detokenizer is finished")
        deltas = []
        for token_id in token_ids:
            self._ids.append(token_id)
            self._num_tokens += 1
            new_text = self._decode(self._ids)
            if len(new_text) > len(self._prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
                deltas.append(new_text[len(self._prefix_text):])
                self._advance()
        delta = "".join(deltas)
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self, drop_incomplete: bool = False) -> str:
        """The request finished: return the held-back text. It ends with U+FFFD only when the output
        ends inside a character; `drop_incomplete` leaves that tail out (vLLM does the same; a U+FFFD
        the model produced as the very last character is then dropped too)."""
        if self._flushed:
            return ""
        self._flushed = True
        new_text = self._decode(self._ids)
        delta = new_text[len(self._prefix_text):] if len(new_text) > len(self._prefix_text) else ""
        if drop_incomplete:
            delta = delta.rstrip(REPLACEMENT_CHAR)
        if delta:
            self._parts.append(delta)
        return delta

    def _advance(self) -> None:
        """The window's text ended on a complete character: the new tokens become the prefix."""
        del self._ids[:self._read_offset]  # prefix_offset moves to the old read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
