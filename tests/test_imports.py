"""The pure-Python floors never import mlx or metrale (checked in a fresh interpreter)."""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import scheduler

ACCOUNTING = ["kvcache", "kvcache.blocks", "kvcache.hashing", "kvcache.manager"]


def test_scheduler_and_kvcache_accounting_import_without_mlx_or_metrale():
    modules = ["scheduler"] + [
        f"scheduler.{m.name}" for m in pkgutil.iter_modules([str(Path(scheduler.__file__).parent)])
    ]
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules + ACCOUNTING!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('mlx', 'metrale', 'numpy'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(result.stdout) == []
    assert "scheduler.scheduler" in modules and "scheduler.request" in modules
