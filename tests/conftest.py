"""Shared test setup: the fast BLAS is loaded before any test imports mlx; event loops per marker."""

import asyncio

import pytest

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

try:
    import uvloop
except ImportError:  # uvloop is installed on Linux and macOS; elsewhere only asyncio runs
    uvloop = None


def pytest_configure(config):
    config.addinivalue_line("markers", "both_loops: run the async tests under asyncio and under uvloop")


def pytest_asyncio_loop_factories(config, item):
    """Tests marked `both_loops` run once per event loop implementation."""
    if item.get_closest_marker("both_loops") and uvloop is not None:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a tiny random llama GGUF (2 layers, hidden 64, 101-token vocab, chatml, context 512)."""
    from tests.metrale.model_helpers import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny") / "tiny.gguf"), max_position_embeddings=512)
