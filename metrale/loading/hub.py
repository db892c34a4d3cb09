"""Resolve a Hugging Face hub id (`org/name`) to a local model folder with huggingface_hub.

The local cache is tried first (`local_files_only=True`), the network only when the cache lacks
the model and huggingface_hub is not offline (HF_HUB_OFFLINE). Only what the folder loader reads
is downloaded. huggingface_hub is optional: without it a hub id is an error that says so.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from metrale.loading.default_model import ModelNotFoundError

__all__ = ["FOLDER_FILES", "looks_like_hub_id", "resolve_hub_model"]

FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja"]  # config, weights (+ index), tokenizer, templates
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_hub_id(name: str) -> bool:
    """Whether `name` has the form of a hub id: `name` or `org/name`, no path syntax."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and ".." not in name


def resolve_hub_model(repo_id: str, *, cache_dir: str | Path | None = None) -> Path:
    """The local snapshot folder of hub model `repo_id`, downloading it when allowed and needed.

    ModelNotFoundError naming the id and the cache directory when it cannot be had."""
    if importlib.util.find_spec("huggingface_hub") is None:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a file or folder, and huggingface_hub is not installed to resolve it as a "
            "hub id (pip install huggingface_hub)"
        )
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True, allow_patterns=FOLDER_FILES))
    except HFValidationError as e:
        raise ModelNotFoundError(f"{repo_id!r} is neither a file, a folder nor a valid hub id: {e}") from e
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{repo_id!r} is not a file or folder, and hub model {repo_id} is not in the local cache "
                f"{cache} (HF_HUB_OFFLINE is set, so it was not downloaded)"
            ) from e
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, allow_patterns=FOLDER_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError) as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a file or folder, and hub model {repo_id} is neither in the local cache "
            f"{cache} nor downloadable: {e}"
        ) from e
