"""The models found on disk: --models DIR (one level down), --model NAME=PATH, sizes, ids that collide."""

from __future__ import annotations

import pytest

from metrale.manager.catalog import ModelEntry, catalog, discover, parse_model_spec


def _gguf(path, size=10):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def _folder(path, size=20):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * (size - 2))
    return path


def test_a_folder_lists_gguf_files_and_model_folders_one_level_down(tmp_path):
    _gguf(tmp_path / "b.gguf", 10)
    _folder(tmp_path / "a-folder", 20)
    _gguf(tmp_path / "org" / "c.gguf", 30)
    _folder(tmp_path / "org" / "d", 40)
    _gguf(tmp_path / "org" / "deeper" / "e.gguf")  # two levels down: not listed
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    assert discover(tmp_path) == [
        ModelEntry("a-folder", str(tmp_path / "a-folder"), 20), ModelEntry("b", str(tmp_path / "b.gguf"), 10),
        ModelEntry("c", str(tmp_path / "org" / "c.gguf"), 30), ModelEntry("d", str(tmp_path / "org" / "d"), 40)]


def test_name_equals_path_and_bare_paths(tmp_path):
    gguf = _gguf(tmp_path / "x.gguf", 12)
    assert parse_model_spec(f"small={gguf}") == ModelEntry("small", str(gguf), 12)
    assert parse_model_spec(str(gguf)).model_id == "x"
    with pytest.raises(ValueError, match="neither a .gguf file nor a model folder"):
        parse_model_spec(f"n={tmp_path / 'missing.gguf'}")
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_model_spec("n=")
    with pytest.raises(ValueError, match="without spaces"):
        parse_model_spec(f"a b={gguf}")


def test_ids_must_be_unique_and_something_must_be_found(tmp_path):
    _gguf(tmp_path / "m.gguf")
    _gguf(tmp_path / "sub" / "m.gguf")
    with pytest.raises(ValueError, match="model id 'm' is both"):
        catalog(str(tmp_path), [])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model found"):
        catalog(str(tmp_path / "empty"), [])
    with pytest.raises(ValueError, match="not a folder"):
        catalog(str(tmp_path / "nope"), [])
    entries = catalog(None, [f"one={tmp_path / 'm.gguf'}", f"two={tmp_path / 'sub' / 'm.gguf'}"])
    assert [e.model_id for e in entries] == ["one", "two"]
