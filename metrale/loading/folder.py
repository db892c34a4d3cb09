"""Load a Hugging Face / MLX model folder: config.json, safetensors weights, tokenizer files.

    folder/
      config.json                      model_type and hyperparameters (gemma3's text_config too);
                                       "quantization" for MLX-quantized folders (mlx-lm's layout)
      model.safetensors                or model-00001-of-0000N.safetensors + model.safetensors.index.json
      tokenizer.json                   the tokenizer; tokenizer_config.json: chat template, special tokens
      generation_config.json           eos ids and sampling defaults (optional;
                                       metrale.loading.generation_defaults reads the latter)

Weight names are mapped to the model's own (`model.layers.0.self_attn.q_proj.weight`): the
multimodal wrappers' prefixes (`language_model.model.`, `model.language_model.`) are stripped
and their vision towers dropped, bare `layers.` / `embed_tokens.` / `norm.` gain `model.`,
RoPE buffers (`rotary_emb.inv_freq`) go, and `lm_head` goes when the embeddings are tied. MoE
checkpoints' per-expert tensors are stacked and Phi-3's fused projections split (metrale.loading.layouts).

Quantized folders keep their triples (metrale.loading.weights.keep_quantized_default): on a GPU
for MLX's quantized kernels, on CPU for metrale's own (kernels/qmm.py; 4 and 8 bits, groups 32, 64,
128). MLX's CPU quantized_matmul is no alternative there (2-745x slower than float32 BLAS:
benchmarks/load_bench.py --quantized-matmul), so without the kernels, or with an explicit dtype,
CPU weights are dequantized.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernels.runtime import mx, nn

from metrale.loading.default_model import ModelNotFoundError
from metrale.loading.layouts import rename_mixtral, split_fused, stack_experts
from metrale.loading.weights import LoadedModel, build_model, keep_quantized_default
from metrale.models import MODEL_ARCHITECTURES, ModelConfig, supported_architectures
from metrale.text.tokenizer import Tokenizer

__all__ = ["hf_to_model_names", "load_folder", "read_hf_config", "weight_files"]

INDEX_FILE = "model.safetensors.index.json"
_DROPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_RENAMED_PREFIXES = (
    ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."), ("model.language_model.", "model."),
    ("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."), ("norm.", "model.norm."),
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def read_hf_config(folder: Path) -> tuple[dict[str, Any], Mapping[str, Any] | None]:
    """(the text model's config.json mapping, its mlx-lm "quantization" entry or None).

    A multimodal gemma3 config contributes its text_config. ModelNotFoundError without a
    config.json; ValueError for an unsupported architecture or quantization method."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFoundError(f"no config.json in model folder {folder}")
    config = _read_json(path)
    quantization = config.get("quantization")
    legacy = config.get("quantization_config")
    if quantization is None and isinstance(legacy, Mapping) and "quant_method" in legacy:
        raise ValueError(
            f"{path}: quantization_config quant_method {legacy['quant_method']!r} is not supported; "
            "metrale loads float weights and MLX-quantized folders (config 'quantization')"
        )
    arch = config.get("model_type")
    if arch == "gemma3" and isinstance(config.get("text_config"), Mapping):  # multimodal: the text model only
        text = config["text_config"]
        outer = {k: config[k] for k in ("torch_dtype", "dtype", "tie_word_embeddings") if k in config}
        config = {**outer, **text, "model_type": text.get("model_type", arch)}
        arch = config["model_type"]
    if arch not in MODEL_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r} in {path}; supported: {', '.join(supported_architectures())}"
        )
    return config, quantization


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the shards its index names, else model*.safetensors,
    else *.safetensors. ModelNotFoundError naming what was looked for."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing or not names:
            raise ModelNotFoundError(
                f"{index} names shards {names} but {missing or 'none'} are missing from {folder}"
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("model*.safetensors")) or sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"no weights in model folder {folder}: looked for {INDEX_FILE}, model*.safetensors and *.safetensors"
        )
    return files


def _model_name(name: str) -> str | None:
    """The model's parameter name for a checkpoint tensor name; None for tensors that are dropped."""
    if name.startswith(_DROPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            name = new + name.removeprefix(old)
            break
    return rename_mixtral(name) if ".block_sparse_moe." in name else name


def hf_to_model_names(weights: Mapping[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Checkpoint tensor names -> the model's parameter names (see the module docstring)."""
    out: dict[str, mx.array] = {}
    for name, array in weights.items():
        target = _model_name(name)
        if target is None or (config.tie_word_embeddings and target.startswith("lm_head.")):
            continue
        module, _, part = target.rpartition(".")
        for piece, value in (split_fused(module, array, config) or {module: array}).items():
            if f"{piece}.{part}" in out:
                raise ValueError(f"tensor {piece}.{part} appears twice in the checkpoint (as {name} and another name)")
            out[f"{piece}.{part}"] = value
    return stack_experts(out, config.num_experts) if config.num_experts else out


def _renamed_quantization(quantization: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """mlx-lm's per-module quantization entries under the model's module paths."""
    if quantization is None:
        return None
    renamed = {}
    for key, value in quantization.items():  # "group_size", "bits", "mode", then module paths
        if isinstance(value, Mapping):
            module = _model_name(f"{key}.weight")
            if module is None:
                continue
            key = module.removesuffix(".weight")
        renamed[key] = value
    return renamed


def _read_weights(folder: Path) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    for file in weight_files(folder):
        shard = mx.load(str(file))
        clash = sorted(set(shard) & set(weights))
        if clash:
            raise ValueError(f"{file} repeats tensors of an earlier shard: {', '.join(clash[:5])}")
        weights.update(shard)
    return weights


def _tokenizer(folder: Path) -> Tokenizer:
    if not (folder / "tokenizer.json").is_file():
        found = sorted(p.name for p in folder.glob("tokenizer*"))
        raise ModelNotFoundError(
            f"no tokenizer.json in model folder {folder} (found: {', '.join(found) or 'no tokenizer files'}); "
            "metrale reads Hugging Face fast tokenizers (tokenizer.json)"
        )
    return Tokenizer.from_folder(folder)


def load_folder(
    folder: str | Path, *, keep_quantized: bool | None = None, dtype: mx.Dtype | None = None,
    shard: Callable[[nn.Module], None] | None = None,
) -> LoadedModel:
    """Load a Hugging Face / MLX model folder with its tokenizer.

    keep_quantized: None = metrale.loading.weights.keep_quantized_default (kept on a GPU, and on CPU
    with dtype None and the CPU kernels built).
    dtype: activations and float weights; None = float32 on CPU, and on a GPU bfloat16 for
    bfloat16 checkpoints, else float16.
    """
    start = time.perf_counter()
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"no model folder at {folder}")
    hf_config, quantization = read_hf_config(folder)
    config = ModelConfig.from_hf_dict(hf_config)
    on_cpu = mx.default_device() == mx.cpu
    keep = keep_quantized_default(keep_quantized, dtype)
    if dtype is None:
        stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
        dtype = mx.float32 if on_cpu else (mx.bfloat16 if stored == "bfloat16" else mx.float16)
    tokenizer = _tokenizer(folder)
    weights = hf_to_model_names(_read_weights(folder), config)
    model, quantized = build_model(
        config, weights, keep_quantized=keep, dtype=dtype, quantization=_renamed_quantization(quantization),
        shard=shard,
    )
    return LoadedModel(
        model=model, config=config, tokenizer=tokenizer, path=folder, dtype=dtype,
        quantization=quantized, load_seconds=time.perf_counter() - start,
    )
