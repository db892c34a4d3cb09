"""`metrale tokenizer export`: the folder loads back into the same tokenizer (ids, special tokens, template)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from metrale.cli import main
from metrale.text.tokenizer import Tokenizer

TEXTS = ["Hello world!", "  leading spaces and\ttabs\n", "Cửa Việt 東京 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.real_model
def test_the_default_models_tokenizer_exports_and_loads_back(tmp_path):
    from metrale.loading.tokenizer_only import load_tokenizer

    assert main(["tokenizer", "export", str(tmp_path / "tok")]) == 0
    original = load_tokenizer(None)
    exported = Tokenizer.from_folder(tmp_path / "tok")
    plain = HFTokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    for text in TEXTS:
        assert exported.encode(text) == original.encode(text) == plain.encode(text).ids
    assert (exported.bos_token_id, exported.eos_token_ids[0], exported.chat_template) == \
        (original.bos_token_id, original.eos_token_ids[0], original.chat_template)
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == "<|im_end|>"


def test_a_gguf_tokenizer_exports_and_loads_back(tmp_path):
    from tests.metrale.model_helpers import byte_vocab, make_twins, tiny_config_dict, write_tiny_gguf
    from mlx.utils import tree_flatten

    config = tiny_config_dict(vocab_size=320)
    _, model = make_twins(config)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), config, tree_flatten(model.parameters()), vocab=byte_vocab(320))
    assert main(["tokenizer", "export", str(tmp_path / "out"), "--model", str(path)]) == 0
    from metrale.loading.tokenizer_only import load_tokenizer

    original = load_tokenizer(path)
    exported = Tokenizer.from_folder(tmp_path / "out")
    for text in TEXTS[:2]:
        assert exported.encode(text) == original.encode(text)


@pytest.mark.parametrize("name", ["llama-bpe", "qwen2", "gemma-4", "llama-spm", "deepseek-coder", "bert-bge"])
def test_llama_cpp_vocabularies_export_to_the_same_ids(tmp_path, name):
    """Every kind of GGUF vocabulary (byte-level BPE with pre-tokenizer regexes, SentencePiece, Gemma 4, WordPiece)
    survives the round trip through tokenizer.json: llama.cpp's test cases encode to the same ids."""
    from metrale.loading.tokenizer_only import load_tokenizer
    from tests.metrale.text.test_gguf_vocab import read_cases
    from tests.llamacpp_assets import models_dir

    folder = models_dir()
    assert main(["tokenizer", "export", str(tmp_path / name), "--model", str(folder / f"ggml-vocab-{name}.gguf")]) == 0
    original = load_tokenizer(folder / f"ggml-vocab-{name}.gguf")
    exported = Tokenizer.from_folder(tmp_path / name)
    for text, _ in read_cases(folder, name):
        assert exported.encode(text) == original.encode(text), (name, text)
