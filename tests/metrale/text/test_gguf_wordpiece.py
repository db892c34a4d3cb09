"""The GGUF "bert" vocabulary as WordPiece, with llama.cpp's normalisation quirks."""

from __future__ import annotations

import pytest

from metrale.text.gguf_wordpiece import original_wordpiece_token, wordpiece

TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "▁hello", "▁world", "▁ᄀ", "▁e", "▁un", "aff", "able", "▁!", "s"]


def encode(text: str, **metadata) -> list[str]:
    backend = wordpiece(metadata, TOKENS, unk=1)
    return [TOKENS[i] for i in backend.encode(text).ids]


def test_vocab_spelling_is_undone():
    assert [original_wordpiece_token(t) for t in ["▁the", "ing", "[CLS]", "[unused0]"]] == [
        "the", "##ing", "[CLS]", "[unused0]",
    ]


def test_longest_pieces_then_unk_for_a_word_that_cannot_be_spelled():
    assert encode("Hello unaffable worlds!") == ["▁hello", "▁un", "aff", "able", "▁world", "s", "▁!"]
    assert encode("hello xyz") == ["▁hello", "[UNK]"]
    assert encode("hello" * 40) == ["[UNK]"]  # no match for the second "hello" as a continuation


def test_llama_cpps_normalisation():
    assert encode("hello\x0bworld") == ["▁hello", "▁world"]  # \v splits words, as llama.cpp's whitespace
    assert encode("\uad6d") == ["▁ᄀ"]  # a Hangul syllable keeps only its leading consonant
    assert encode("e\u0903") == ["▁e"]  # every mark goes (U+0903 is a spacing mark, Mc)
    assert encode("HELLO", **{"tokenizer.ggml.normalizer.lowercase": False}) == ["[UNK]"]


def test_needs_an_unknown_token():
    with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.unknown_token_id'"):
        wordpiece({}, TOKENS, unk=None)
