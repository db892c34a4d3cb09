"""The many-models serve flags: which flags serve many, the manager they build, and what they refuse."""

from __future__ import annotations

import math

import pytest

from metrale.server.cli import engine_config
from metrale.server.model_flags import model_specs, models_from_flags, serves_many
from tests.metrale.manager.fakes import LoadableEngine
from tests.server.test_cli import _parse


def _build(*argv: str):
    args = _parse(*argv)
    return models_from_flags(args, engine_config(args), LoadableEngine, lambda: b"")


def test_one_model_path_keeps_the_one_engine_server():
    args = _parse("--model", "m.gguf")
    assert not serves_many(args) and engine_config(args).model == "m.gguf"
    assert not serves_many(_parse())


@pytest.mark.parametrize("argv", [("--models", "/m"), ("--model", "a=x.gguf"),
                                  ("--model", "x.gguf", "--model", "y.gguf")])
def test_these_serve_many(argv):
    args = _parse(*argv)
    assert serves_many(args) and engine_config(args).model is None


def test_flags_build_the_manager(tmp_path):
    for name in ("b", "a"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF" + b"\0" * 96)
    models = _build("--models", str(tmp_path), "--model", f"extra={tmp_path / 'a.gguf'}", "--kv-cache-mib", "8",
                    "--max-resident-bytes", "512M", "--idle-unload-after", "-1", "--max-waiting", "7")
    manager = models.manager
    assert list(manager.slots) == ["a", "b", "extra"] and models.model_id == "a"
    assert (manager.config.max_resident_bytes, manager.config.kv_cache_bytes) == (512 << 20, 8 << 20)
    assert manager.config.idle_unload_after_s == math.inf and manager.config.max_waiting_per_model == 7
    assert manager.slots["a"].resident_bytes == 100 + (8 << 20)
    assert model_specs(_parse("--model", "x=1", "--model", "y=2")) == ["x=1", "y=2"]


@pytest.mark.parametrize(("argv", "message"), [
    (("--model", "a=x.gguf", "--served-model-name", "n"), "--served-model-name"),
    (("--model", "a=missing.gguf"), "neither a .gguf file"),
    (("--models", "/nonexistent-folder"), "not a folder"),
    (("--model", "a=x.gguf", "--max-resident-bytes", "lots"), "byte count")])
def test_bad_flags_are_refused(tmp_path, argv, message):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    argv = tuple(a.replace("x.gguf", str(tmp_path / "x.gguf")) for a in argv)
    with pytest.raises(ValueError, match=message):
        _build(*argv)


def test_lora_adapters_are_refused_with_models_loaded_on_demand(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="LoRA adapters"):
        _build("--model", f"a={tmp_path / 'x.gguf'}", "--enable-runtime-lora-updating")
