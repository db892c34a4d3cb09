"""The house's import rules: floors import only downwards, the pure floors never load mlx, and mlx is
first imported in one place (kernels/runtime.py, right after the OpenBLAS preload)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kernels", "kvcache", "scheduler", "metrale")

# The floor of each room (longest prefix wins): a module may import its own room or lower floors.
FLOORS = {
    "kernels": 0,
    "kvcache": 1,
    "scheduler": 2,
    "metrale": 3, "metrale.config": 3, "metrale.errors": 3, "metrale.outputs": 3, "metrale.sampling_params": 3,
    "metrale.failpoints": 3, "metrale.settings": 3, "metrale.speculative.config": 3,
    "metrale.text": 4, "metrale.sampling": 4, "metrale.models": 4, "metrale.speculative": 4,
    "metrale.loading": 5,
    # the step message is the engine's contract; tensor parallelism uses it, and only a TP engine uses that room
    "metrale.engine.step": 6,
    "metrale.distributed": 7,
    "metrale.engine": 8,
    "metrale.manager": 9,  # several engines, one per resident model: between the server and the engine
    "metrale.server": 10, "metrale.bench": 10, "metrale.cli": 11, "metrale.demo": 10,
}
# What the server may take from the engine room: its typed interface and the stream it returns.
SERVER_ENGINE_API = ("metrale.engine.protocol", "metrale.engine.stream")
MLX_FREE = ["scheduler", "kvcache", "kvcache.blocks", "kvcache.hashing", "kvcache.manager", "kernels.settings",
            "metrale", "metrale.settings",
            "metrale.config", "metrale.errors", "metrale.outputs", "metrale.sampling_params", "metrale.models",
            "metrale.text", "metrale.text.tokenizer", "metrale.text.gguf_vocab", "metrale.text.gguf_pretokenizers",
            "metrale.text.gguf_sentencepiece", "metrale.text.gguf_wordpiece", "metrale.text.gguf_special_tokens",
            "metrale.text.chat_template",
            "metrale.text.detokenizer", "metrale.text.stop", "metrale.text.processor", "metrale.engine",
            "metrale.engine.protocol", "metrale.engine.stream", "metrale.server", "metrale.server.app",
            "metrale.server.completions", "metrale.structured_outputs", "metrale.text.tool_parsers",
            "metrale.text.tool_calls", "metrale.text.json_scan", "metrale.server.tools", "metrale.server.structured",
            "metrale.server.worker_api", "metrale.server.fleet",
            "metrale.manager.manager", "metrale.server.managed"]


def _modules() -> list[tuple[str, Path]]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found.append((name, path))
    return found


def _floor(module: str) -> int | None:
    best = None
    for prefix, floor in FLOORS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, floor)
    return None if best is None else best[1]


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "metrale" and len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` are skipped)."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for n in ast.walk(node)}
    names = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_nothing_imports_upwards():
    upward = []
    for module, path in _modules():
        floor, room = _floor(module), _room(module)
        for imported in _imports(path):
            target = _floor(imported)
            if target is None or _room(imported) == room:
                continue
            if target > floor:
                upward.append(f"{module} -> {imported}")
    assert upward == []


def test_server_uses_only_the_engine_protocol():
    reaching = [f"{module} -> {imported}" for module, path in _modules() if module.startswith("metrale.server")
                and module != "metrale.server.cli"  # the command starts the real engine
                for imported in _imports(path)
                if imported.startswith("metrale.engine") and imported not in SERVER_ENGINE_API]
    assert reaching == []


def test_mlx_is_first_imported_in_one_place():
    direct = [f"{module}: {imported}" for module, path in _modules() if module != "kernels.runtime"
              for imported in _imports(path) if imported in ("mlx.core", "mlx.nn", "mlx")]
    assert direct == []


def test_pure_floors_and_text_import_without_mlx():
    code = (
        "import importlib, json, sys\n"
        f"for name in {MLX_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'numpy', 'mlx_lm'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_lazy_public_api_loads_the_engine_on_first_use():
    code = ("import sys, metrale\n"
            "assert 'mlx.core' not in sys.modules\n"
            "from metrale import AsyncEngine, EngineConfig, SamplingParams\n"
            "print('mlx.core' in sys.modules, AsyncEngine.__module__)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "metrale.engine.async_engine"]


@pytest.mark.parametrize("name", ["metrale.nope"])
def test_unknown_public_name_is_an_attribute_error(name):
    import metrale

    with pytest.raises(AttributeError, match="nope"):
        getattr(metrale, name.split(".")[1])


def test_a_one_rank_engine_never_imports_the_distributed_room():
    code = ("import sys, metrale.engine.async_engine, metrale.engine.runner, metrale.engine.core\n"
            "print(sorted(m for m in sys.modules if m.startswith('metrale.distributed')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]


def test_the_grammar_engine_is_imported_only_when_a_grammar_is_compiled():
    code = ("import sys, metrale.engine.runner, metrale.engine.async_engine, metrale.server.app\n"
            "print(sorted(m for m in sys.modules if m.startswith('llguidance')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]
