"""GGUF tokenizers against llama.cpp's own test vectors: every vocabulary of llama.cpp's tokenizer test set
(models/ggml-vocab-*.gguf with .inp/.out), every case, read as tests/test-tokenizer-0.cpp reads them; and
the special-token facts a GGUF states (bos / [CLS] ... [SEP], gemma4's forced bos, refusals)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.llamacpp_assets import VERSION, models_dir, vocab_names
from tests.metrale.model_helpers import CONTROL_TOKENS, tiny_vocab

import mlx.core as mx  # noqa: E402  (model_helpers loads the fast BLAS first)

from metrale.text.tokenizer import Tokenizer  # noqa: E402

# models/ggml-vocab-NAME.gguf.out of the llama.cpp that llama-cpp-python VERSION vendors
VOCABULARIES = (
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
    "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
)
_SEPARATOR = "\n__ggml_vocab_test__\n"


def read_cases(folder: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs as test-tokenizer-0.cpp reads them: the .inp cut at every separator
    (the text after the last one is a case only when not empty), one stripped .out line per case."""
    raw = (folder / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts = raw.split(_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(lines), f"{name}: {len(texts)} inputs but {len(lines)} expected outputs"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def test_the_vocabularies_are_llama_cpps():
    assert tuple(vocab_names()) == VOCABULARIES, f"llama.cpp {VERSION}'s vocabularies changed: update VOCABULARIES"


@pytest.mark.parametrize("name", VOCABULARIES)
def test_every_case_gives_llama_cpps_ids(name):
    """llama.cpp runs these with add_special=false, parse_special=false; no case holds a special token's
    text, so the default encode (which matches them) is the same call. Decoding gives the text back,
    except for WordPiece, which lowercases, strips accents and drops whitespace by design."""
    folder = models_dir()
    metadata = mx.load(str(folder / f"ggml-vocab-{name}.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf_metadata(metadata)
    cases = read_cases(folder, name)
    assert len(cases) >= 40
    for index, (text, expected) in enumerate(cases):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == expected, f"{name} case {index} {text!r}: llama.cpp {expected}, metrale {ids}"
        if metadata["tokenizer.ggml.model"] != "bert":
            assert tok.decode(ids) == text, f"{name} case {index} {text!r} does not decode back"


def test_llama3_takes_a_whole_word_from_the_vocab_before_merging():
    """llama.cpp's ignore_merges for llama-bpe: ' Việt' is one token although no merge chain makes it."""
    metadata = mx.load(str(models_dir() / "ggml-vocab-llama-bpe.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("Cửa Việt", add_special_tokens=False) == [34, 91163, 101798]
    assert tok.encode("Cửa Việt")[0] == tok.bos_token_id  # llama3 adds a bos by default


def test_a_byte_the_vocab_cannot_spell_is_dropped_after_merging():
    """Falcon's vocab has no \\v: llama.cpp (libllama 0c1e570) gives [26, 1001, 258, 204, 28], not 'ĊĊĠĠ'."""
    metadata = mx.load(str(models_dir() / "ggml-vocab-falcon.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf_metadata(metadata)
    assert tok.encode("/\n\n\x0b   1") == [26, 1001, 258, 204, 28]


def test_bert_wraps_in_cls_and_sep():
    metadata = mx.load(str(models_dir() / "ggml-vocab-bert-bge.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf_metadata(metadata)
    ids = tok.encode("Hello World!")
    assert tok.convert_ids_to_tokens(ids) == ["[CLS]", "hello", "world", "!", "[SEP]"]
    assert tok.decode(ids, skip_special_tokens=True) == "hello world!"


def test_gemma4_always_adds_bos_and_spells_spaces():
    metadata = mx.load(str(models_dir() / "ggml-vocab-gemma-4.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": mx.array(False)})
    ids = tok.encode("Hello  world\n\n")
    assert ids[0] == tok.bos_token_id == 2  # llama.cpp overrides add_bos_token=false for gemma4
    assert tok.decode(ids, skip_special_tokens=True) == "Hello  world\n\n"


def tiny_metadata(**overrides):
    tokens, merges = tiny_vocab(101)
    return {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in CONTROL_TOKENS else 1 for t in tokens], dtype=mx.int32),
        **overrides,
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, r"'rwkv' is not supported; supported: 'gpt2'.*'bert' \(WordPiece\)"),
        ({"tokenizer.ggml.pre": "kimi-k2"}, r"pre-tokenizer 'kimi-k2' is not supported; supported: .*qwen35"),
        ({"tokenizer.ggml.merges": ["ab"]}, r"merge 'ab' has no space"),
        ({"tokenizer.ggml.model": "bert"}, r"'bert' vocabulary lacks 'tokenizer.ggml.unknown_token_id'"),
        ({"tokenizer.ggml.padding_token_id": mx.array(101)}, r"padding token id 101 out of range .* 101 tokens"),
    ],
)
def test_refusals_name_the_problem(overrides, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_metadata(tiny_metadata(**overrides))
