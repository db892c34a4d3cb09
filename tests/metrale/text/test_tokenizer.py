"""The tokenizer built from GGUF metadata or tokenizer.json: ids, specials, eos, errors; the real
SmolLM2 tokenizer against known ids and against transformers' own GGUF conversion."""

from __future__ import annotations

import json

import pytest

from tests.metrale.model_helpers import CHATML_TEMPLATE, CONTROL_TOKENS, tiny_vocab

import mlx.core as mx  # noqa: E402  (model_helpers loads the fast BLAS first)

from metrale.loading.default_model import ModelNotFoundError, default_model_path  # noqa: E402
from metrale.text.tokenizer import Tokenizer  # noqa: E402


def tiny_metadata(**overrides):
    tokens, merges = tiny_vocab(101)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3 if t in CONTROL_TOKENS else 1 for t in tokens], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(0, dtype=mx.uint32),
        "tokenizer.chat_template": CHATML_TEMPLATE,
        **overrides,
    }


def test_specials_merges_and_round_trip():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata())
    hello = tok.encode("hello world")
    assert tok.convert_ids_to_tokens(hello) == ["he", "ll", "o", "Ġwor", "l", "d"]
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 2 + 3
    assert tok.decode(ids) == "<|im_start|>hello<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "hello"
    assert tok.encode("a 42!") == [tok.token_to_id(t) for t in ["a", "Ġ", "4", "2", "!"]]  # digits alone
    assert tok.special_tokens == CONTROL_TOKENS
    assert (tok.vocab_size, tok.bos_token_id, tok.bos_token) == (101, 1, "<|im_start|>")
    assert tok.id_to_token(3) == "a" and tok.id_to_token(5000) is None


def test_eos_includes_the_templates_end_of_turn():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata())
    assert tok.eos_token_ids == (0, 2)  # file eos <|endoftext|>, then <|im_end|> from the chat template
    assert tok.eos_tokens == ("<|endoftext|>", "<|im_end|>")
    no_template = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.chat_template": None}))
    assert no_template.eos_token_ids == (0,) and no_template.chat_template is None


def test_add_bos_token_wraps_encodings_only_with_special_tokens():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.add_bos_token": mx.array(True)}))
    assert tok.encode("ab")[0] == 1
    assert tok.encode("ab", add_special_tokens=False) == [3, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tokenizer.ggml.model": "rwkv"}, r"tokenizer model 'rwkv' is not supported; supported: 'gpt2' \(byte-level"),
        ({"tokenizer.ggml.pre": "chameleon"}, r"pre-tokenizer 'chameleon' is not supported; supported: .*smollm"),
        ({"tokenizer.ggml.eos_token_id": mx.array(500)}, r"eos token id 500 out of range for a vocabulary of 101"),
    ],
)
def test_gguf_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_metadata(tiny_metadata(**overrides))


def test_missing_vocab_is_named():
    metadata = tiny_metadata()
    del metadata["tokenizer.ggml.merges"]
    with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.merges'"):
        Tokenizer.from_gguf_metadata(metadata)


def test_convert_ids_rejects_out_of_range():
    tok = Tokenizer.from_gguf_metadata(tiny_metadata())
    with pytest.raises(ValueError, match="token id 101 out of range"):
        tok.convert_ids_to_tokens([1, 101])


def test_from_folder(tmp_path):
    """tokenizer.json + tokenizer_config.json (specials, template) + generation_config.json (eos ids)."""
    original = Tokenizer.from_gguf_metadata(tiny_metadata())
    original.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"content": "<|endoftext|>"}, "chat_template": CHATML_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_folder(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (1, (0, 2), CHATML_TEMPLATE)
    assert tok.encode("<|im_start|>hello world") == original.encode("<|im_start|>hello world")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path / "nowhere")


# -- the real SmolLM2 tokenizer ---------------------------------------------------------------

SAMPLES = [
    "Hello world",
    "<|im_start|>user\nHi<|im_end|>",
    "The year 2024 had 366 days.",
    "  indented\n\n\tcode = {'a': 1}  ",
    "héllo wörld — naïve café",
    "日本語のテキスト 🎉",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def gguf_metadata():
    try:
        path = default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return mx.load(str(path), return_metadata=True)[1]


@pytest.mark.real_model
def test_real_tokenizer_known_ids(gguf_metadata):
    tok = Tokenizer.from_gguf_metadata(gguf_metadata)
    assert tok.encode("Hello world") == [19556, 905]
    assert tok.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert tok.encode('" \x1d?|s0') == [18, 216, 44817, 99, 32]  # llama.cpp's: no merge across the unknown \x1d
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.eos_tokens) == (49152, 1, (2,), ("<|im_end|>",))
    assert "<|im_start|>" in tok.chat_template and len(tok.special_tokens) == 17
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.real_model
def test_real_tokenizer_matches_transformers_gguf_conversion(gguf_metadata):
    """transformers converts GGUF tokenizers without torch (its converter reads our metadata)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {
        name: gguf_metadata[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in gguf_metadata
    }
    tokenizer_dict["token_type"] = gguf_metadata["tokenizer.ggml.token_type"].tolist()
    reference, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    tok = Tokenizer.from_gguf_metadata(gguf_metadata)
    for text in SAMPLES:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids, text


# -- SentencePiece ("llama") vocabularies: Llama 2, TinyLlama, Mistral GGUFs --------------------

SP_PIECES = [
    "▁", *"abcdefghijklmnopqrstuvwxyz", "▁h", "he", "ll", "lo", "▁he", "llo", "▁hel", "▁hello",
    "▁w", "or", "▁wor", "ld", "▁world", "▁t", "th", "▁the", "in", "▁in", "er", "▁▁",
]


def sentencepiece_metadata(**overrides):
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tokens = ["<unk>", "<s>", "</s>", *bytes_, *SP_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(SP_PIECES))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": mx.array(scores),
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=mx.uint32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=mx.uint32),
        "tokenizer.ggml.unknown_token_id": mx.array(0, dtype=mx.uint32),
        **overrides,
    }


def test_sentencepiece_merges_bytes_and_bos():
    tok = Tokenizer.from_gguf_metadata(sentencepiece_metadata())
    ids = tok.encode("hello world")
    assert ids[0] == 1  # llama.cpp adds bos to SentencePiece vocabularies unless told otherwise
    assert tok.convert_ids_to_tokens(ids[1:]) == ["▁hello", "▁world"]
    pieces = tok.convert_ids_to_tokens(tok.encode("hé!", add_special_tokens=False))
    assert pieces == ["▁h", "<0xC3>", "<0xA9>", "<0x21>"]  # byte fallback
    for text in ["hello world", "hé!", "the  world\nin"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    assert tok.eos_token_ids == (2,) and tok.bos_token == "<s>"


def test_sentencepiece_space_prefix_follows_llama_cpp():
    """llama.cpp prefixes a space to the text and again after each special token."""
    tok = Tokenizer.from_gguf_metadata(sentencepiece_metadata())
    assert tok.convert_ids_to_tokens(tok.encode("</s>hello", add_special_tokens=False)) == ["</s>", "▁hello"]
    assert tok.convert_ids_to_tokens(tok.encode(" the", add_special_tokens=False)) == ["▁", "▁the"]  # "▁▁the"
    off = Tokenizer.from_gguf_metadata(sentencepiece_metadata(**{"tokenizer.ggml.add_space_prefix": mx.array(False)}))
    assert off.convert_ids_to_tokens(off.encode("hello", add_special_tokens=False))[0] == "he"


def test_sentencepiece_matches_transformers_gguf_conversion():
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    metadata = sentencepiece_metadata()
    tokenizer_dict = {
        "tokenizer_type": "llama", "tokens": metadata["tokenizer.ggml.tokens"],
        "scores": metadata["tokenizer.ggml.scores"].tolist(),
        "token_type": metadata["tokenizer.ggml.token_type"].tolist(),
    }
    reference, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    tok = Tokenizer.from_gguf_metadata(metadata)
    for text in ["hello world", "the world in hello", "héllo wörld!", "hello\n\nworld  in", "xyz qq"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids, text
