"""The models a server answers for, found on disk before any is loaded.

    --models DIR          every *.gguf file in DIR and in its subfolders (one level down), and every model folder
                          (one holding config.json) in DIR or one level down; id = the file's stem / folder's name
    --model NAME=PATH     one model under the id NAME (repeatable; PATH a GGUF file or model folder; a bare PATH
                          is named as in DIR)

Ids must be unique (two files with one stem are refused, naming both); the order is the listing's (DIR entries
sorted by name, then --model ones) and the first is the default model of a request that names none.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MODEL_FOLDER_MARKER = "config.json"
MAX_MODEL_ID_CHARS = 256


@dataclass(frozen=True)
class ModelEntry:
    """One model on disk: the id requests name it by, its GGUF file or model folder, and its size in bytes."""

    model_id: str
    path: str
    size_bytes: int


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(child.stat().st_size for child in path.rglob("*") if child.is_file())


def is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / MODEL_FOLDER_MARKER).is_file()


def entry_for(model_id: str, path: Path) -> ModelEntry:
    """The entry of a GGUF file or model folder; ValueError when it is neither or the id is unusable."""
    if not model_id or len(model_id) > MAX_MODEL_ID_CHARS or any(c.isspace() for c in model_id):
        raise ValueError(f"model id {model_id!r} must be 1..{MAX_MODEL_ID_CHARS} characters without spaces")
    if not (path.is_file() and path.suffix == ".gguf") and not is_model_folder(path):
        raise ValueError(f"{path} is neither a .gguf file nor a model folder (one holding {MODEL_FOLDER_MARKER})")
    return ModelEntry(model_id, str(path), size_on_disk(path))


def discover(folder: Path) -> list[ModelEntry]:
    """The models in `folder` and one level below it (see the module docstring), sorted by path."""
    if not folder.is_dir():
        raise ValueError(f"--models {folder}: not a folder")
    found: list[ModelEntry] = []
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        if _is_model(child):
            found.append(entry_for(_model_id(child), child))
        elif child.is_dir():
            found += [entry_for(_model_id(grandchild), grandchild) for grandchild in sorted(child.iterdir())
                      if not grandchild.name.startswith(".") and _is_model(grandchild)]
    return found


def parse_model_spec(spec: str) -> ModelEntry:
    """`NAME=PATH` (a repeated --model) as an entry; a bare PATH is named by its file stem / folder name."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = os.path.expanduser(spec)
        return entry_for(_model_id(Path(path)), Path(path))
    if not path:
        raise ValueError(f"--model {spec!r}: expected NAME=PATH")
    return entry_for(name, Path(os.path.expanduser(path)))


def catalog(models_dir: str | None, specs: list[str]) -> list[ModelEntry]:
    """Every entry of --models DIR and the --model NAME=PATH specs; ValueError for a repeated id or none found."""
    entries = discover(Path(os.path.expanduser(models_dir))) if models_dir else []
    entries += [parse_model_spec(spec) for spec in specs]
    seen: dict[str, str] = {}
    for entry in entries:
        if entry.model_id in seen:
            raise ValueError(f"model id {entry.model_id!r} is both {seen[entry.model_id]} and {entry.path}; "
                             "rename one or name it with --model NAME=PATH")
        seen[entry.model_id] = entry.path
    if not entries:
        raise ValueError(f"no model found (--models {models_dir}: no .gguf file or model folder)")
    return entries


def _is_model(path: Path) -> bool:
    return (path.is_file() and path.suffix == ".gguf") or is_model_folder(path)


def _model_id(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" and path.is_file() else path.name
