"""The GGUF "bert" vocabulary (BERT, BGE, nomic-embed): WordPiece as llama.cpp's WPM tokenizer runs it.

llama.cpp's converter stores a word-start piece as "▁piece", a continuation ("##piece" in the
original vocab) as "piece", and bracketed tokens ("[CLS]", "[unused0]") as they are. Undoing that
gives back the original WordPiece vocab, which `tokenizers`' WordPiece then runs as llama.cpp's
`llm_tokenizer_wpm_session` does: BERT normalisation (control characters dropped, CJK characters
split off, accents stripped after NFD and lower case where the file asks, both on by default;
llama.cpp's NFD keeps the first code point only, which differs from Unicode's for Hangul syllables),
words split at whitespace and punctuation, each word greedily cut into the longest known pieces
or one [UNK]. Never imports mlx.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from metrale.text.gguf_sentencepiece import plain

__all__ = ["original_wordpiece_token", "wordpiece"]

_CONTINUATION = "##"


def original_wordpiece_token(gguf_token: str) -> str:
    """The vocab entry as the HF WordPiece vocab spells it ("▁the" -> "the", "ing" -> "##ing")."""
    if gguf_token.startswith("▁"):
        return gguf_token[1:]
    if gguf_token.startswith("[") and gguf_token.endswith("]"):
        return gguf_token
    return _CONTINUATION + gguf_token


def _hangul_to_leading_consonant() -> list[normalizers.Normalizer]:
    """llama.cpp's NFD keeps one code point per character: a Hangul syllable becomes its leading
    consonant jamo alone (U+AC00 + 588 k ... + 587 -> U+1100 + k), where true NFD gives two or three."""
    steps = []
    for k in range(19):
        first = 0xAC00 + 588 * k
        steps.append(normalizers.Replace(Regex(f"[{chr(first)}-{chr(first + 587)}]"), chr(0x1100 + k)))
    return steps


def wordpiece(metadata: Mapping[str, Any], tokens: list[str], unk: int | None) -> HFTokenizer:
    """The WordPiece pipeline of a "bert" GGUF vocabulary."""
    if unk is None:
        raise ValueError("GGUF 'bert' vocabulary lacks 'tokenizer.ggml.unknown_token_id'")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab[original_wordpiece_token(token)] = index  # a repeated spelling keeps its last id, as llama.cpp
    # llama.cpp has no limit on a word's length; 2**31 - 1 keeps every word WordPiece's business
    model = models.WordPiece(
        vocab=vocab, unk_token=original_wordpiece_token(tokens[unk]), max_input_chars_per_word=2**31 - 1
    )
    backend = HFTokenizer(model)
    lowercase = bool(plain(metadata.get("tokenizer.ggml.normalizer.lowercase", True)))
    strip_accents = bool(plain(metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    bert = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip_accents, lowercase=lowercase
    )
    # llama.cpp splits words at \v, \f, U+0085, U+2028 and U+2029 too (BERT's cleaning drops the first three)
    steps = [normalizers.Replace(Regex("[\x0b\x0c\x85\u2028\u2029]"), " "), bert]
    if strip_accents:  # every mark goes, where BERT strips only the non-spacing ones (Mn)
        steps = [*_hangul_to_leading_consonant(), *steps, normalizers.Replace(Regex(r"\p{M}"), "")]
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix=_CONTINUATION, cleanup=True)
    return backend
