"""llama.cpp's public test assets, for tests that compare metrale with llama.cpp's own expectations:
tokenizer vocabularies with expected ids (`models/ggml-vocab-*.gguf` + `.inp`/`.out`) and real chat
templates (`models/templates/*.jinja`).

They come from the llama-cpp-python sdist on PyPI (it vendors llama.cpp's source), downloaded once with
pip and unpacked (those two kinds of files only) into ~/.cache/metrale/; nothing of it is committed.
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

VERSION = "0.3.36"  # llama.cpp 0c1e570, the same source benchmarks/peers/build_llama_server.sh builds
CACHE = Path.home() / ".cache" / "metrale" / f"llama-cpp-python-{VERSION}"
_MEMBER_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"


def _wanted(name: str) -> bool:
    if not name.startswith(_MEMBER_PREFIX):
        return False
    rest = name[len(_MEMBER_PREFIX):]
    return rest.startswith("ggml-vocab-") or rest.startswith("templates/")


def _unpack(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and _wanted(m.name)]
        for member in members:
            member.name = member.name[len(_MEMBER_PREFIX):]
        tar.extractall(dest, members=members, filter="data")


def models_dir() -> Path:
    """llama.cpp's `models/` folder (vocabularies and templates/), fetched on first use.

    Skips the calling test, saying why, when PyPI cannot be reached."""
    done = CACHE / "models" / ".complete"
    if done.exists():
        return done.parent
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several test processes may ask at once
        if not done.exists():
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
                cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                       "-d", tmp, f"llama-cpp-python=={VERSION}"]
                result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if result.returncode != 0:
                    pytest.skip(f"llama-cpp-python {VERSION} sdist not downloadable: {result.stderr[-300:]}")
                (sdist,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
                _unpack(sdist, CACHE / "models")
            done.touch()
    return done.parent


def vocab_names() -> list[str]:
    """Names of the vocabularies that come with expected ids (`ggml-vocab-NAME.gguf.out`)."""
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf.out")] for p in models_dir().glob("ggml-vocab-*.gguf.out"))


def template_path(name: str) -> Path:
    """models/templates/NAME (e.g. "Qwen-Qwen3-0.6B.jinja")."""
    path = models_dir() / "templates" / name
    if not path.exists():
        raise FileNotFoundError(f"no template {name} in llama.cpp {VERSION}'s models/templates/")
    return path
