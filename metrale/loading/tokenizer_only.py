"""A model's tokenizer without its weights: what `metrale tokenizer export` needs."""

from __future__ import annotations

from pathlib import Path

from metrale.loading import hub
from metrale.loading.default_model import ModelNotFoundError, default_model_path
from metrale.loading.gguf_file import read_gguf_metadata
from metrale.text.tokenizer import Tokenizer


def load_tokenizer(model: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file (None: the default model), a model folder or a hub id, as load_model builds it."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        return Tokenizer.from_folder(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a model: give a .gguf file, a model folder or a hub id")
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))  # the header only
    if isinstance(model, str) and hub.looks_like_hub_id(model):
        return Tokenizer.from_folder(hub.resolve_hub_model(model))
    raise ModelNotFoundError(f"no model file or folder at {path}")
