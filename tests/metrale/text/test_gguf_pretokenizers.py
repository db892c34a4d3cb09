"""llama.cpp's BPE pre-tokenizers by `tokenizer.ggml.pre` name: every family builds, splits as llama.cpp's
regex lists do (each regex splitting what the previous one left), and unknown names are refused."""

from __future__ import annotations

import pytest

from metrale.text.gguf_pretokenizers import GGUF_PRE_TOKENIZERS, PreTokenizerRule, pre_tokenizer_rule


def pieces(name: str, text: str) -> list[str]:
    """The pre-tokens of `text`, spelled back as text (the byte-level mapping undone)."""
    byte_level = pre_tokenizer_rule(name).build().pre_tokenize_str(text)
    decoder = {chr(c): bytes([b]) for b, c in _bytes_to_unicode().items()}
    return [b"".join(decoder[ch] for ch in piece).decode("utf-8") for piece, _ in byte_level]


def _bytes_to_unicode() -> dict[int, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = b
        else:
            mapping[b] = 256 + extra
            extra += 1
    return mapping


@pytest.mark.parametrize("name", sorted(GGUF_PRE_TOKENIZERS))
def test_every_family_builds_and_keeps_every_character(name):
    text = "Hello world's 12345 +=> 日本語  \n\n\tx"
    assert "".join(pieces(name, text)) == text


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("gpt-2", "I'll pay 12345!", ["I", "'ll", " pay", " 12345", "!"]),
        ("smollm", "pay 123", ["pay", " ", "1", "2", "3"]),  # every digit alone first
        ("llama-bpe", "I'LL pay 12345", ["I", "'LL", " pay", " ", "123", "45"]),
        ("qwen2", "x 123", ["x", " ", "1", "2", "3"]),
        ("qwen35", "e\u0301t\u00e9", ["e\u0301t\u00e9"]),  # marks stay in the word
        ("falcon", "a+=b 1234", ["a", "+=", "b", " ", "123", "4"]),
        ("deepseek-coder", "ab\ncd", ["ab", "\n", "cd"]),
        # llama.cpp's \s-to-\v rewrite keeps U+3000 out of deepseek-llm's literal punctuation range
        ("deepseek-llm", "\t\t\u3000", ["\t\t\u3000"]),
    ],
)
def test_splits_as_llama_cpp(name, text, expected):
    assert pieces(name, text) == expected


def test_families_carry_llama_cpps_flags():
    assert pre_tokenizer_rule("llama-bpe") == PreTokenizerRule(pre_tokenizer_rule("llama3").regexes, True, True)
    assert not pre_tokenizer_rule("qwen2").ignore_merges and not pre_tokenizer_rule("qwen2").add_bos
    assert pre_tokenizer_rule(None) is GGUF_PRE_TOKENIZERS["default"]


def test_unknown_name_and_empty_rule_are_refused():
    with pytest.raises(ValueError, match=r"'chameleon' is not supported; supported: .*llama-bpe"):
        pre_tokenizer_rule("chameleon")
    with pytest.raises(ValueError, match="at least one regex"):
        PreTokenizerRule(())


def test_a_character_the_vocab_lacks_stands_alone():
    """llama.cpp merges around a byte its vocab cannot spell (then drops it): it must split the word."""
    tokenize = pre_tokenizer_rule("gpt-2").build(unspellable="ċ]").pre_tokenize_str
    assert [piece for piece, _ in tokenize("\n\n\x0b a]b")] == ["ĊĊ", "ċ", "Ġa", "]", "b"]
