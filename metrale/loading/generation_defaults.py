"""The sampling defaults a model ships with: generation_config.json in a model folder, general.sampling.*
in a GGUF file (what llama.cpp's newer converters copy from it).

    generation_config.json        GGUF                              SamplingParams
    temperature                   general.sampling.temp             temperature
    top_p / top_k / min_p         general.sampling.top_p / top_k / min_p
    repetition_penalty            general.sampling.penalty_repeat   repetition_penalty

A request's own value wins; the server's --generation-config vllm ignores these (vLLM's flag).
Only the GGUF header is read (its key/value section), never the tensors.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from metrale.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_sampling_defaults(path: str | Path) -> dict[str, Any]:
    """The model's sampling defaults ({} when it ships none); ValueError on a malformed file."""
    path = Path(path)
    if path.is_dir():
        config_file = path / "generation_config.json"
        if not config_file.is_file():
            return {}
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{config_file} is not valid JSON: {error}") from error
        return from_generation_config(config)
    return from_gguf_metadata(gguf_sampling_metadata(path))


def from_generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling fields of a generation_config.json mapping. do_sample false means greedy (temperature 0)."""
    defaults = {name: config[name] for name in SAMPLING_FIELDS if _number(config.get(name))}
    if config.get("do_sample") is False:
        defaults = {"temperature": 0.0}  # transformers ignores the other knobs when it does not sample
    return _checked(defaults)


def from_gguf_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    return _checked({GGUF_KEYS[key]: value for key, value in metadata.items() if key in GGUF_KEYS and _number(value)})


def gguf_sampling_metadata(path: Path) -> dict[str, Any]:
    """The general.sampling.* keys of a GGUF file's header."""
    found: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _num_tensors, num_keys = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        for _ in range(num_keys):
            key = _string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            value = _value(f, kind, keep=key.startswith("general.sampling."))
            if key in GGUF_KEYS:
                found[key] = value
    return found


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f) if keep else _skip_string(f)
    if kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", f.read(12))
        if item_kind in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_kind]), 1)
        else:
            for _ in range(count):
                _value(f, item_kind, keep=False)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def _string(f: BinaryIO) -> str:
    (size,) = struct.unpack("<Q", f.read(8))
    return f.read(size).decode("utf-8", errors="replace")


def _skip_string(f: BinaryIO) -> None:
    (size,) = struct.unpack("<Q", f.read(8))
    f.seek(size, 1)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked(defaults: dict[str, Any]) -> dict[str, Any]:
    """Values SamplingParams accepts (a model file's odd value is logged and left out, never a failed start)."""
    kept = {}
    for name, value in defaults.items():
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as error:
            logger.warning("ignoring the model's default %s=%r: %s", name, value, error)
            continue
        kept[name] = value
    return kept
