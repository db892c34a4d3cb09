"""benchmarks/gguf_shapes_bench.py's writer: the Llama-3.2-1B and -3B shapes by their GGUF metadata, each
written with one layer (the metadata of the full shape otherwise) so that the test stays fast."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
pytestmark = pytest.mark.timeout(120)  # two files of ~0.2-0.3 GB (the 128256-token embedding dominates)


@pytest.fixture
def shapes(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("gguf_shapes_bench")


@pytest.mark.parametrize(("name", "dims"), [
    ("llama-3b", {"hidden": 3072, "ffn": 8192, "heads": 24, "kv_heads": 8, "head_dim": 128}),
    ("llama-1b", {"hidden": 2048, "ffn": 8192, "heads": 32, "kv_heads": 8, "head_dim": 64}),
])
def test_a_shape_written_with_one_layer_reads_back_as_that_shape(shapes, tmp_path, name, dims):
    from peers import estimate

    path = shapes.write_shape(tmp_path / f"{name}.gguf", name, layers=1)
    shape = shapes.read_shape(path)
    assert shape == {"arch": "llama", "layers": 1, **dims, "vocab": 128256, "context_length": 8192}
    assert shape == shapes.expected_shape(name, layers=1)
    assert shapes.expected_shape(name)["layers"] == {"llama-3b": 28, "llama-1b": 16}[name]
    metadata = shapes.read_metadata(path)
    assert metadata["tokenizer.ggml.tokens"] == 128256 and metadata["general.file_type"] == 2  # MOSTLY_Q4_0
    # the Q4_0 weights of one layer and a tied embedding (no output matrix), the norms and the vocabulary
    assert path.stat().st_size == pytest.approx(estimate.weight_bytes(shape), rel=0.02)
    assert list(tmp_path.iterdir()) == [path]  # nothing partial left beside it


def test_an_existing_file_is_kept_when_its_shape_matches_and_replaced_when_not(shapes, tmp_path):
    path = tmp_path / "small.gguf"
    shapes.write_shape(path, "qwen3moe", layers=1)
    written = path.stat().st_mtime_ns
    assert shapes.write_shape(path, "qwen3moe", layers=1) == path and path.stat().st_mtime_ns == written
    shapes.write_shape(path, "qwen3moe", layers=2)  # another shape under the same name: written again
    shape = shapes.read_shape(path)
    assert (shape["layers"], shape["experts"], shape["top_k"], shape["ffn"]) == (2, 16, 4, 768)
    with pytest.raises(ValueError, match="not a GGUF"):
        shapes.read_metadata(Path(__file__))
