"""SamplingParams: every per-request generation knob, validated once at construction.

Invalid values raise InvalidParamsError (a ValueError) before anything is queued, naming the parameter in
`field`; the message starts with the field name and states the allowed range, e.g. ``temperature must be
a number in [0, 2], got 3.5``. Decoding from JSON or a dict (`from_dict`, `from_json`) runs the same
checks and raises msgspec's ValidationError, which is a ValueError too.

Ranges follow OpenAI where OpenAI defines the knob (temperature [0, 2], presence/frequency penalty
[-2, 2], top_logprobs 0..20, logit_bias -100..100) and vLLM otherwise (top_k 0/-1 = off, min_p [0, 1],
allowed_token_ids, bad_words, structured_outputs); the repetition penalty is bounded to [0.01, 100],
where float32 logits divided or multiplied by it stay finite. Semantics of the penalties and of
logprobs are documented in metrale/sampling/sampler.py. Token ids are checked against the model's
vocabulary when the request is submitted (the vocabulary is not known here).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from metrale.structured_outputs import StructuredOutputs
from scheduler.errors import InvalidParamsError

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# float32 logits divided / multiplied by the penalty stay finite and ordered inside this range
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (as vLLM's _SAMPLING_EPS)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100..100
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids in logit_bias
MAX_TOKEN_IDS = 65_536  # token ids in allowed_token_ids, and in stop_token_ids
_SEED_RANGE = (-(2**63), 2**64 - 1)
# Client-chosen sizes, bounded before any work scales with them (each stop string is compiled into the
# request's matcher, each bad word tokenized twice, when the request is submitted).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 8192  # all stop strings together
MAX_BAD_WORDS = 128
MAX_BAD_WORDS_CHARS = 8192  # all bad words together
MAX_BAD_WORDS_TOKEN_IDS = 8 * MAX_BAD_WORDS_CHARS  # in all: a character is 4 byte tokens at most, twice


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one request samples and when it stops.

    max_tokens: output tokens to generate at most (>= 1); None: as many as the context has room for
        (max_model_len minus the prompt, and what the KV pool can hold).
    temperature: 0 (or below 1e-5) is greedy argmax; otherwise logits are divided by it. [0, 2].
    top_k: keep the k most likely tokens (ties with the k-th are kept); 0 or -1 turns it off.
    top_p: nucleus sampling, keep the smallest set of most likely tokens whose mass >= top_p. (0, 1].
    min_p: drop tokens whose probability is below min_p times the most likely one's. [0, 1].
    seed: makes sampling reproducible: the token at output position i depends only on the logits,
        the params, the seed and i, never on the batch it runs in. None: the engine's own stream.
    stop: strings that end generation when they appear in the output text (a str or a sequence;
        stored as a tuple; at most MAX_STOP_STRINGS, MAX_STOP_CHARS characters in all). The stop
        string itself is not returned unless include_stop_str_in_output.
    stop_token_ids: token ids that end generation (the token is counted but not detokenized).
    ignore_eos: keep generating past the model's end-of-sequence tokens.
    min_tokens: eos and stop_token_ids cannot be sampled before this many output tokens.
    repetition_penalty: [0.01, 100]; 1 is off. Divides positive / multiplies negative logits of every token
        already in the prompt or the output (HF/vLLM semantics).
    presence_penalty, frequency_penalty: [-2, 2]; 0 is off. Subtracted from the logits of tokens
        already in the output: presence once, frequency once per occurrence (OpenAI semantics).
    logprobs: None for none; n in 0..20 returns the sampled token's log probability plus the n most
        likely alternatives.
    include_stop_str_in_output: keep the matched stop string at the end of the text.
    skip_special_tokens: leave special tokens (e.g. <|im_end|>) out of the detokenized text.
    logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling (OpenAI semantics:
        -100 effectively bans a token, +100 all but forces it).
    allowed_token_ids: only these ids may be sampled (vLLM); None allows every id.
    bad_words: strings whose token sequences must not be generated (vLLM): the last token of a bad
        word is banned when the output ends with its other tokens. The engine tokenizes each word with
        and without a leading space into bad_words_token_ids when the request is submitted (or, through
        `AsyncEngine.prepare`, off the event loop). At most MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS in all.
    bad_words_token_ids: token-id sequences banned the same way (the engine adds the bad_words' here).
    n: how many output sequences to sample from the prompt (parallel sampling). They share the prompt's
        KV blocks; sequence i samples with seed + i when a seed is set, else from the engine's stream.
    prompt_logprobs: None for none; k in 0..20 returns, for every prompt token after the first, its log
        probability given the tokens before it plus the k most likely alternatives. The request then
        computes its whole prompt (no prefix-cache reads).
    structured_outputs: a JSON schema, regex, choice list or grammar the output must satisfy
        (metrale.structured_outputs; needs the `metrale[structured]` extra). The output ends with
        finish_reason "stop" as soon as the constraint is complete, even under ignore_eos/min_tokens.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputs | None = None
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_top_k(self.top_k)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, *_SEED_RANGE)
        msgspec.structs.force_setattr(self, "stop", _normalize_stop(self.stop))
        msgspec.structs.force_setattr(self, "stop_token_ids", _normalize_token_ids(self.stop_token_ids))
        _check_bool("ignore_eos", self.ignore_eos)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParamsError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                                     field="min_tokens")
        _check_number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        force = msgspec.structs.force_setattr
        force(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            force(self, "allowed_token_ids", _normalize_token_ids(self.allowed_token_ids, "allowed_token_ids"))
            if not self.allowed_token_ids:
                raise InvalidParamsError("allowed_token_ids must hold at least one token id, got []",
                                         field="allowed_token_ids")
        force(self, "bad_words", _normalize_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORDS_CHARS))
        force(self, "bad_words_token_ids", _normalize_sequences(self.bad_words_token_ids))
        if self.structured_outputs is not None:
            force(self, "structured_outputs", _structured_outputs(self.structured_outputs))
        _check_int("n", self.n, 1, None)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    # ---- derived ----

    @property
    def is_greedy(self) -> bool:
        """True when the token is the argmax (temperature 0 or below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition / presence / frequency penalties is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_token_masks(self) -> bool:
        """True when logit_bias, allowed_token_ids, bad words or structured outputs restrict the tokens."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids
                    or self.structured_outputs is not None)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (empty when there are none)."""
        return self.stop or ()  # type: ignore[return-value]  # normalized to a tuple in __post_init__

    def for_sequence(self, index: int) -> "SamplingParams":
        """The params of output sequence `index` of n: one sequence, seed + index (wrapping in 64 bits);
        prompt logprobs only on sequence 0, the one that computes the prompt."""
        seed = self.seed
        if seed is not None and index:
            seed = (seed + index) % (2**64) if seed >= 0 else seed + index
        return msgspec.structs.replace(self, n=1, seed=seed,
                                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    # ---- decoding (HTTP server, config files) ----

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from plain values (e.g. parsed JSON), type-checked by msgspec; unknown keys are refused.

        Raises msgspec.ValidationError (a ValueError) naming the field.
        """
        return msgspec.convert(values, cls)

    @classmethod
    def from_json(cls, data: bytes | str) -> "SamplingParams":
        """Decode a JSON object of sampling fields; raises msgspec.ValidationError (a ValueError)."""
        return msgspec.json.decode(data, type=cls)

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain Python values, the inverse of `from_dict`."""
        return msgspec.to_builtins(self)


# ---- checks: each raises InvalidParamsError(f"{field} must be ..., got {value!r}", field=field) ----

def _structured_outputs(value: object) -> StructuredOutputs:
    try:
        return StructuredOutputs.coerce(value)
    except InvalidParamsError:
        raise
    except ValueError as error:
        raise InvalidParamsError(str(error), field="structured_outputs") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):  # type: ignore[operator]
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidParamsError(f"{name} must be an integer {allowed}, got {value!r}", field=name)


def _check_number(name: str, value: object, low: float, high: float, *, low_open: bool = False,
                  field: str | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and value <= high  # type: ignore[operator]
    if not ok:
        if math.isinf(high):
            allowed = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidParamsError(f"{name} must be a finite number {allowed}, got {value!r}", field=field or name)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidParamsError(f"{name} must be true or false, got {value!r}", field=name)


def _check_top_k(value: object) -> None:
    if not _is_int(value) or value < -1:  # type: ignore[operator]
        raise InvalidParamsError(f"top_k must be an integer >= 1, or 0 / -1 to turn it off, got {value!r}",
                                 field="top_k")


def _normalize_stop(stop: object) -> tuple[str, ...] | None:
    return _normalize_strings("stop", stop, MAX_STOP_STRINGS, MAX_STOP_CHARS)


def _normalize_strings(name: str, value: object, max_items: int, max_chars: int) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise InvalidParamsError(f"{name} must be a string or a list of strings, got {type(value).__name__}",
                                 field=name)
    if len(items) > max_items:
        raise InvalidParamsError(f"{name} must hold at most {max_items} strings, got {len(items)}", field=name)
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidParamsError(f"{name} must hold non-empty strings, got {item!r:.100}", field=name)
    total = sum(len(item) for item in items)
    if total > max_chars:
        raise InvalidParamsError(f"{name} must hold at most {max_chars} characters in all, got {total}", field=name)
    return tuple(items) or None


def _normalize_token_ids(ids: object, name: str = "stop_token_ids") -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise InvalidParamsError(f"{name} must be a list of token ids, got {type(ids).__name__}", field=name)
    if len(ids) > MAX_TOKEN_IDS:
        raise InvalidParamsError(f"{name} must hold at most {MAX_TOKEN_IDS} token ids, got {len(ids)}", field=name)
    for token_id in ids:
        if not _is_int(token_id) or token_id < 0:
            raise InvalidParamsError(f"{name} must hold integers >= 0, got {token_id!r}", field=name)
    return tuple(ids)


def _normalize_sequences(sequences: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(sequences, (list, tuple)):
        raise InvalidParamsError("bad_words_token_ids must be a list of token id lists, got "
                                 f"{type(sequences).__name__}", field="bad_words_token_ids")
    if len(sequences) > MAX_BAD_WORDS_TOKEN_IDS:
        raise InvalidParamsError(f"bad_words_token_ids must hold at most {MAX_BAD_WORDS_TOKEN_IDS} token ids in all, "
                                 f"got {len(sequences)} sequences", field="bad_words_token_ids")
    out = []
    total = 0
    for ids in sequences:
        total += len(ids) if isinstance(ids, (list, tuple)) else 0
        if total > MAX_BAD_WORDS_TOKEN_IDS:
            raise InvalidParamsError(f"bad_words_token_ids must hold at most {MAX_BAD_WORDS_TOKEN_IDS} token ids in all",
                                     field="bad_words_token_ids")
        ids = _normalize_token_ids(ids, "bad_words_token_ids")
        if not ids:
            raise InvalidParamsError("bad_words_token_ids must hold non-empty token id lists, got []",
                                     field="bad_words_token_ids")
        out.append(ids)
    return tuple(out)


def _normalize_logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidParamsError("logit_bias must be an object mapping token ids to numbers, got "
                                 f"{type(bias).__name__}", field="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParamsError(f"logit_bias must hold at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(bias)}",
                                 field="logit_bias")
    for token_id, value in bias.items():
        if not _is_int(token_id) or token_id < 0:
            raise InvalidParamsError(f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}",
                                     field="logit_bias")
        _check_number(f"logit_bias[{token_id}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, field="logit_bias")
    return {token_id: float(value) for token_id, value in bias.items()} or None
