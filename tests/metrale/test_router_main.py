"""metrale.router_main: sglang-router's launcher with the API key from the environment, not the command line."""

import subprocess
import sys

import pytest

from metrale import router_main


@pytest.fixture
def launched(monkeypatch):
    launch = pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed")
    seen = []
    monkeypatch.setattr(launch, "launch_router", seen.append)  # the router itself runs in tests/server/test_fleet*
    return seen


def test_the_key_comes_from_the_environment(monkeypatch, launched):
    monkeypatch.setenv(router_main.API_KEY_VARIABLE, "s3cret")
    router_main.main(["--worker-urls", "http://127.0.0.1:1", "--policy", "round_robin"])
    (args,) = launched
    assert args.api_key == "s3cret" and args.worker_urls == ["http://127.0.0.1:1"] and args.policy == "round_robin"


def test_no_key_when_the_variable_is_unset_or_empty(monkeypatch, launched):
    monkeypatch.setenv(router_main.API_KEY_VARIABLE, "")
    router_main.main(["--worker-urls", "http://127.0.0.1:1"])
    assert launched[0].api_key is None


def test_importing_it_loads_neither_mlx_nor_the_engine():
    code = "import sys, metrale.router_main; print(sorted(m for m in sys.modules if m.startswith(('mlx', 'metrale.engine'))))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
