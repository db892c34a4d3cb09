"""LoRA adapter folders, read and checked against a base model without loading a tensor (pure Python).

Two layouts (both an adapter_config.json and one safetensors file):

    mlx-lm   adapters.safetensors       model.layers.N.self_attn.q_proj.lora_a  (in, r)   lora_b (r, out)
             adapter_config.json        {"fine_tune_type": "lora", "lora_parameters": {"rank", "scale", ...}}
             scale = lora_parameters.scale (absolute, mlx-lm's y = W x + scale * (x @ a) @ b)
    PEFT     adapter_model.safetensors  base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight (r, in)
                                                                                ... .lora_B.weight (out, r)
             adapter_config.json        {"peft_type": "LORA", "r", "lora_alpha", "use_rslora", ...}
             scale = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora

The targets are what the safetensors header holds: every tensor must be the A or B of a projection the
base model has (q, k, v, o, gate, up, down of a layer it has), with the shapes that projection needs and
one rank for the whole adapter, at most `max_rank`. Anything else (DoRA, embeddings, modules_to_save,
per-module ranks) is refused with a ValueError naming it, before any weight is read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from metrale.models.config import ModelConfig

__all__ = ["LORA_ARCHITECTURES", "AdapterModule", "AdapterSpec", "lora_targets", "read_adapter"]

# families whose layers are LlamaAttention + LlamaMLP (metrale.models.llama), which metrale.models.lora wraps
LORA_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
TARGET_KEYS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MAX_HEADER_BYTES = 16 * 1024 * 1024  # a safetensors header above this is refused before it is parsed
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_MLX_NAME = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.(lora_a|lora_b)$")
_PEFT_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
                        r"\.(lora_A|lora_B)\.weight$")


def lora_targets(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each projection an adapter may target -> its (in_features, out_features); {} when the family has no
    LoRA support here."""
    if config.architecture not in LORA_ARCHITECTURES:
        return {}
    dim, hidden = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = [(dim, q_out), (dim, kv_out), (dim, kv_out), (q_out, dim), (dim, hidden), (dim, hidden), (hidden, dim)]
    return dict(zip(TARGET_KEYS, shapes))


@dataclass(frozen=True, slots=True)
class AdapterModule:
    """One adapted projection: the tensors' names in the file; `transposed`: stored as PEFT does,
    A (r, in) and B (out, r), rather than mlx-lm's A (in, r) and B (r, out)."""

    layer: int
    key: str  # e.g. "self_attn.q_proj"
    a_name: str
    b_name: str
    transposed: bool


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter folder: y += scale * (x @ A) @ B on each module, A (in, rank), B (rank, out)."""

    path: str
    weights_file: str
    layout: str  # "mlx" | "peft"
    rank: int
    scale: float
    modules: tuple[AdapterModule, ...]

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(m.key for m in self.modules)


def read_adapter(path: str | Path, num_layers: int, targets: dict[str, tuple[int, int]],
                 max_rank: int) -> AdapterSpec:
    """Read and check the adapter folder at `path` against a base model of `num_layers` layers whose
    projections have the shapes `targets` (lora_targets). ValueError naming the problem otherwise."""
    folder = Path(path)
    if not targets:
        raise ValueError("this model's architecture has no LoRA support (llama, mistral, qwen2 and qwen3 have)")
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter path {str(folder)!r} is not a folder")
    config = _read_config(folder / "adapter_config.json")
    layout, weights, rank, scale = _layout(folder, config)
    header = _read_header(weights)
    modules = _modules(header, layout, num_layers, targets, rank, max_rank)
    return AdapterSpec(str(folder), str(weights), layout, rank, scale, modules)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"LoRA adapter folder has no adapter_config.json ({path})")
    if path.stat().st_size > 1024 * 1024:
        raise ValueError(f"{path} is larger than 1 MiB")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config


def _number(config: dict, key: str, where: str) -> float:
    value = config.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"adapter_config.json: {where}{key} must be a finite number, got {value!r}")
    return value


def _layout(folder: Path, config: dict) -> tuple[str, Path, int, float]:
    """("mlx" | "peft", the weights file, the configured rank, the scale)."""
    if "lora_parameters" in config:
        if config.get("fine_tune_type", "lora") != "lora":
            raise ValueError(f"fine_tune_type {config.get('fine_tune_type')!r} is not supported (only lora)")
        params = config["lora_parameters"]
        if not isinstance(params, dict):
            raise ValueError("adapter_config.json: lora_parameters must be an object")
        rank = _number(params, "rank", "lora_parameters.")
        return "mlx", folder / "adapters.safetensors", int(rank), float(_number(params, "scale", "lora_parameters."))
    if str(config.get("peft_type", "")).upper() == "LORA":
        for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
            if config.get(key):
                raise ValueError(f"adapter_config.json: {key} is not supported")
        if config.get("bias", "none") != "none":
            raise ValueError(f"adapter_config.json: bias {config.get('bias')!r} is not supported (only 'none')")
        rank, alpha = _number(config, "r", ""), _number(config, "lora_alpha", "")
        if rank < 1:
            raise ValueError(f"adapter_config.json: r must be >= 1, got {rank}")
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        return "peft", folder / "adapter_model.safetensors", int(rank), float(scale)
    raise ValueError("adapter_config.json is neither mlx-lm's (lora_parameters) nor PEFT's (peft_type LORA)")


def _read_header(path: Path) -> dict:
    """The safetensors header: tensor name -> {dtype, shape, data_offsets}; checked to fit the file."""
    if not path.is_file():
        raise ValueError(f"LoRA adapter folder has no {path.name}")
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path.name} is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path.name}: safetensors header of {length} bytes does not fit (file {size} bytes)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path.name}: bad safetensors header: {error}") from error
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: bad safetensors header")
    header.pop("__metadata__", None)
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _DTYPE_BYTES or not isinstance(info.get("shape"), list):
            raise ValueError(f"{path.name}: tensor {name!r} must be F32, F16 or BF16 with a shape")
        begin, end = info.get("data_offsets", (0, -1))
        if math.prod(info["shape"]) * _DTYPE_BYTES[info["dtype"]] != end - begin or end > size - 8 - length:
            raise ValueError(f"{path.name}: tensor {name!r} does not fit its data offsets")
    return header


def _modules(header: dict, layout: str, num_layers: int, targets: dict[str, tuple[int, int]], rank: int,
             max_rank: int) -> tuple[AdapterModule, ...]:
    pattern, transposed = (_MLX_NAME, False) if layout == "mlx" else (_PEFT_NAME, True)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in header:
        match = pattern.match(name)
        if match is None:
            raise ValueError(f"tensor {name!r} is not the LoRA A or B of a supported projection "
                             f"({', '.join(TARGET_KEYS)})")
        layer, key, which = int(match[1]), match[2], match[3].lower()
        if layer >= num_layers or key not in targets:
            raise ValueError(f"tensor {name!r} targets a module the base model does not have "
                             f"({num_layers} layers)")
        pairs.setdefault((layer, key), {})[which] = name
    if not pairs:
        raise ValueError("the adapter holds no LoRA tensors")
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} is outside 1..max_lora_rank ({max_rank})")
    modules = []
    for (layer, key), names in sorted(pairs.items()):
        if set(names) != {"lora_a", "lora_b"}:
            raise ValueError(f"layer {layer} {key}: needs both lora A and lora B, found {sorted(names)}")
        fan_in, fan_out = targets[key]
        a_shape, b_shape = header[names["lora_a"]]["shape"], header[names["lora_b"]]["shape"]
        want_a, want_b = ([rank, fan_in], [fan_out, rank]) if transposed else ([fan_in, rank], [rank, fan_out])
        if a_shape != want_a or b_shape != want_b:
            raise ValueError(f"layer {layer} {key}: lora A {a_shape} / B {b_shape} do not match the base model "
                             f"(expected {want_a} / {want_b} for rank {rank})")
        modules.append(AdapterModule(layer, key, names["lora_a"], names["lora_b"], transposed))
    return tuple(modules)
