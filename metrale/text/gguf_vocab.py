"""The HF `tokenizers` pipeline that a GGUF file's tokenizer metadata describes.

A GGUF has no tokenizer.json: it stores llama.cpp's description (tokenizer.ggml.model, pre,
tokens, merges or scores, token_type, special ids). Two families are rebuilt here:

- "gpt2", byte-level BPE (SmolLM2, Llama 3, Qwen): BPE over the stored vocab and merges, the
  pre-tokenizer llama.cpp names by `tokenizer.ggml.pre`, the ByteLevel decoder.
- "llama", SentencePiece BPE (Llama 2, TinyLlama, Mistral): merges recovered from the token scores
  (the highest-scoring merged piece first, as SentencePiece merges), byte fallback to the
  <0xXX> tokens, "▁" for spaces. Like llama.cpp, a space is prefixed to the text and again after
  every special token (`tokenizer.ggml.add_space_prefix`, default on).

In both, CONTROL tokens (token_type 3) become added special tokens, so "<|im_start|>" stays one
id, and USER_DEFINED ones (4) plain added tokens. Never imports mlx: GGUF scalars read by
`mx.load` are taken through their `.item()` / `.tolist()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["GGUF_PRE_TOKENIZERS", "GGUF_TOKENIZER_MODELS", "GGUFTokenizerSpec", "gguf_tokenizer_spec"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _digits_then_bytes() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's smollm/starcoder regexes: every digit alone ("\p{N}"), then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


# tokenizer.ggml.pre -> builder of the matching pre-tokenizer (llama.cpp's regex families).
GGUF_PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt2": _byte_level,
    "gpt-2": _byte_level,
    "smollm": _digits_then_bytes,
    "starcoder": _digits_then_bytes,
    "refact": _digits_then_bytes,
    "codeshell": _digits_then_bytes,
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "dbrx": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    "deepseek-r1-qwen": lambda: _split_then_bytes(_QWEN2_SPLIT),
}
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The backend pipeline and the special-token facts the file states (eos, eot, eom ids in order)."""

    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str | None


def _plain(value: Any) -> Any:
    """A GGUF metadata value as plain Python (mx.array scalars and vectors included)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> HFTokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(GGUF_PRE_TOKENIZERS))}"
        )
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.merges', needed to build the tokenizer")
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as ranked merges: every split (left, right) of a piece into two pieces of the
    vocab, ranked by the merged piece's score, best first (ties: longer left, then longer right)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((score, len(left), len(right), left, right))
    ranked.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], unk: int | None) -> HFTokenizer:
    if "tokenizer.ggml.scores" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.scores', needed to build the tokenizer")
    scores = _plain(metadata["tokenizer.ggml.scores"])
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_token = tokens[unk] if unk is not None else None
    bpe = models.BPE(
        vocab=vocab, merges=merges_from_scores(tokens, scores), unk_token=unk_token, fuse_unk=True, byte_fallback=True
    )
    backend = HFTokenizer(bpe)
    # Normalizers run on each stretch of text between added tokens: the prefix lands after every
    # special token too, as llama.cpp's "add space prefix if the previous fragment was special".
    steps = [normalizers.Replace(" ", "▁")]
    if _plain(metadata.get("tokenizer.ggml.add_space_prefix", True)):
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def gguf_tokenizer_spec(metadata: Mapping[str, Any]) -> GGUFTokenizerSpec:
    """Build the tokenizer a GGUF describes; ValueError naming what is unsupported or missing."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in GGUF_TOKENIZER_MODELS:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            f"'llama' (SentencePiece BPE)"
        )
    if "tokenizer.ggml.tokens" not in metadata:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens', needed to build the tokenizer")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types = _plain(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(_plain(value))

    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens)
    else:
        backend = _sentencepiece_bpe(metadata, tokens, token_id("unknown_token_id"))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _USER_DEFINED]
    )
    bos = token_id("bos_token_id")
    eos = [token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = [i for i in eos if i is not None]
    # llama.cpp adds a bos to SentencePiece vocabularies unless the file says otherwise
    add_bos = bool(_plain(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")))
    add_eos = bool(_plain(metadata.get("tokenizer.ggml.add_eos_token", False)))
    for name, index in (("bos", bos), ("eos", eos[0] if eos else None)):
        if index is not None and not 0 <= index < len(tokens):
            raise ValueError(f"GGUF {name} token id {index} out of range for a vocabulary of {len(tokens)} tokens")
    _set_post_processor(backend, tokens, bos if add_bos else None, eos[0] if add_eos and eos else None)
    return GGUFTokenizerSpec(
        backend=backend, bos_token_id=bos, eos_token_ids=tuple(eos),
        pad_token_id=token_id("padding_token_id"), chat_template=metadata.get("tokenizer.chat_template"),
    )


def _set_post_processor(backend: HFTokenizer, tokens: Sequence[str], bos: int | None, eos: int | None) -> None:
    """Wrap encodings in bos/eos the way the GGUF's add_bos_token / add_eos_token ask."""
    if bos is None and eos is None:
        return
    head = [] if bos is None else [tokens[bos]]
    tail = [] if eos is None else [tokens[eos]]
    specials = [(tokens[i], i) for i in (bos, eos) if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(head + ["$A"] + tail),
        pair=" ".join(head + ["$A"] + tail + head + ["$B:1"] + tail),
        special_tokens=list(dict.fromkeys(specials)),
    )
