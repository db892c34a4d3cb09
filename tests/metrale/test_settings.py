"""RuntimeSettings (metrale/settings.py): built once from config, flags and the environment, documented in one
table (docs/settings.md) that matches the code, and passed down to what the engine builds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.backend import Backends
from kernels.settings import KernelSettings
from metrale import AsyncEngine, EngineConfig
from metrale.settings import ENVIRONMENT, RuntimeSettings
from tests.metrale.engine_helpers import Runners

ROOT = Path(__file__).resolve().parents[2]
# Where the environment may be read: the two settings modules; kernels/runtime.py's preload asks
# kernels/settings.py too. fleet.py's router launcher script reads the key the fleet hands the router.
READERS = {"kernels/settings.py", "metrale/settings.py", "metrale/server/fleet.py"}
ENV_READ = re.compile(r"""(?:environ(?:\.get)?\s*[\(\[]|getenv\s*\()\s*["'](METRALE_\w+)""")


def test_defaults_without_any_variable():
    settings = RuntimeSettings.resolve(EngineConfig(), environ={})
    assert settings == RuntimeSettings()
    assert settings.kernels == KernelSettings() and settings.kernels.activation_bits == 12


def test_config_and_flags_win_over_the_environment():
    env = {"METRALE_FAILPOINTS": "execute=1", "METRALE_API_KEY": "from-env", "METRALE_ATTENTION": "REFERENCE",
           "METRALE_QMM_ACTIVATIONS": "int8", "METRALE_TP_STEP_TIMEOUT_S": "3", "METRALE_ATTENTION_THREADS": "2",
           "METRALE_LOG_LEVEL": "debug"}
    settings = RuntimeSettings.resolve(EngineConfig(failpoints="sample=@x"), environ=env, api_key="flag")
    assert (settings.failpoints, settings.api_key) == ("sample=@x", "flag")
    assert RuntimeSettings.resolve(EngineConfig(), environ=env).failpoints == "execute=1"
    assert RuntimeSettings.resolve(None, environ=env).api_key == "from-env"
    assert settings.kernels.attention == "reference" and settings.kernels.activation_bits == 8
    assert (settings.tp_step_timeout_s, settings.kernels.attention_threads, settings.log_level) == (3.0, 2, "DEBUG")


@pytest.mark.parametrize(("variable", "value"), [
    ("METRALE_ATTENTION", "fast"), ("METRALE_MATMUL", "yes"), ("METRALE_QMM_ACTIVATIONS", "int4"),
    ("METRALE_ATTENTION_THREADS", "0"), ("METRALE_SPIN_US", "-1"), ("METRALE_SPIN_US", "lots"),
    ("METRALE_TP_STEP_TIMEOUT_S", "soon"), ("METRALE_TP_STEP_TIMEOUT_S", "0"), ("METRALE_LOG_LEVEL", "chatty"),
])
def test_a_bad_value_names_its_variable(variable, value):
    with pytest.raises(ValueError, match=variable):
        RuntimeSettings.resolve(environ={variable: value})


def test_the_docs_table_is_the_code_table():
    table = (ROOT / "docs/settings.md").read_text()
    rows = re.findall(r"^\| `(METRALE_\w+)` \| `([\w.]+)` \| (.*?) \| (.*) \|$", table, re.M)
    assert rows == [(v.name, v.setting, v.default, v.meaning) for v in ENVIRONMENT]
    fields = {f"kernels.{name}" for name in KernelSettings.__dataclass_fields__} | set(
        RuntimeSettings.__dataclass_fields__) - {"kernels"}
    assert {v.setting for v in ENVIRONMENT} == fields  # every setting has its variable, and no other
    assert "docs/settings.md" in (ROOT / "README.md").read_text()


def test_the_environment_is_read_only_by_the_settings():
    found = {}
    for path in [*ROOT.glob("metrale/**/*.py"), *ROOT.glob("kernels/**/*.py"), *ROOT.glob("kvcache/**/*.py"),
                 *ROOT.glob("scheduler/**/*.py"), *ROOT.glob("kernels/csrc/*.[ch]*")]:
        for variable in ENV_READ.findall(path.read_text()):
            found.setdefault(str(path.relative_to(ROOT)), set()).add(variable)
    assert set(found) <= READERS, found
    assert set().union(*found.values()) <= {v.name for v in ENVIRONMENT}


async def test_the_engine_builds_its_model_under_its_settings(tiny_model, monkeypatch):
    monkeypatch.setenv("METRALE_ATTENTION", "kernel")  # the environment says otherwise: the settings win
    reference = KernelSettings(attention="reference", activations="reference", matmul="reference")
    runners = Runners()
    async with AsyncEngine(EngineConfig(model=tiny_model, kv_cache_bytes=1 << 20, block_size=4),
                           settings=RuntimeSettings(kernels=reference), runner_factory=runners) as engine:
        assert runners.runner.backends == Backends(attention="reference", activations="reference",
                                                   matmul="reference")
        assert engine.settings.kernels is reference
        assert (await engine.complete([5, 6, 7], None)).finish_reason == "length"
