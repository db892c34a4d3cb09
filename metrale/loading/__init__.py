"""Model loading: `load_model` takes what `EngineConfig(model=...)` accepts and returns a
`LoadedModel` for the runner.

    None                 the default model (SmolLM2-135M-Instruct GGUF, metrale.loading.default_model)
    path/to/file.gguf    metrale.loading.gguf
    path/to/folder       metrale.loading.folder (Hugging Face / MLX layout)
    org/name             a hub id, resolved to a local folder by metrale.loading.hub
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kernels.runtime import mx, nn

from metrale.loading import folder, gguf, hub
from metrale.loading.default_model import ModelNotFoundError
from metrale.loading.weights import LoadedModel

__all__ = ["LoadedModel", "ModelNotFoundError", "load_model"]


def load_model(
    model: str | Path | None = None, *, dtype: mx.Dtype | None = None, keep_quantized: bool | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer from a GGUF file, a model folder or a hub id (None: the default).

    keep_quantized: None = quantized weights stay quantized on a GPU, and on CPU for dtype None when
    the CPU kernels are built (metrale.loading.weights.keep_quantized_default); an explicit dtype on
    CPU dequantizes to it. dtype: activations and float weights; None = float32 on CPU, float16 (or
    the checkpoint's bfloat16) on a GPU. shard: called on the model once its weights are loaded, before
    the CPU kernels' swap (tensor parallelism keeps one rank's share). ModelNotFoundError says what was looked for when nothing is found.
    """
    if model is None:
        return gguf.load_gguf(None, dtype=dtype, keep_quantized=keep_quantized, shard=shard)
    path = Path(model).expanduser()
    if path.is_dir():
        return folder.load_folder(path, dtype=dtype, keep_quantized=keep_quantized, shard=shard)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is not a model: give a .gguf file, a model folder or a hub id")
        return gguf.load_gguf(path, dtype=dtype, keep_quantized=keep_quantized, shard=shard)
    if isinstance(model, str) and hub.looks_like_hub_id(model):
        return folder.load_folder(hub.resolve_hub_model(model), dtype=dtype, keep_quantized=keep_quantized, shard=shard)
    raise ModelNotFoundError(f"no model file or folder at {path}")
