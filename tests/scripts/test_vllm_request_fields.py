"""scripts/vllm_request_fields.py on a made-up vLLM source tree: it reads the request classes with ast, in the
current layout and the older single-file one, and prints (and exits 1 on) exactly the fields metrale lacks."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from metrale.server.protocol import ChatCompletionRequest, CompletionRequest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_request_fields.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("vllm_request_fields", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_class(path: Path, name: str, fields: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(f"    {field}: int | None = None" for field in fields)
    path.write_text(f"class Base:\n    pass\n\n\nclass {name}(Base):\n{body}\n    _private: int = 0\n\n"
                    f"    def method(self) -> None:\n        local: int = 1\n")


def test_it_prints_the_missing_fields_and_exits_1(script, tmp_path, capsys):
    completion = [*CompletionRequest.__struct_fields__[:3], "brand_new_knob"]
    chat = list(ChatCompletionRequest.__struct_fields__[:5])
    write_class(tmp_path / "vllm/entrypoints/openai/completion/protocol.py", "CompletionRequest", completion)
    write_class(tmp_path / "vllm/entrypoints/openai/chat_completion/protocol.py", "ChatCompletionRequest", chat)
    assert script.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["completions: 4 vLLM fields, 1 not declared by metrale: brand_new_knob",
                   "chat: 5 vLLM fields, 0 not declared by metrale"]


def test_the_older_single_file_layout_and_a_clean_exit(script, tmp_path, capsys):
    path = tmp_path / "vllm/entrypoints/openai/protocol.py"
    write_class(path, "CompletionRequest", ["prompt", "echo"])
    path.write_text(path.read_text() + "\n\nclass ChatCompletionRequest(Base):\n    messages: list = []\n")
    assert script.main([str(tmp_path)]) == 0
    assert "0 not declared" in capsys.readouterr().out


def test_a_tree_without_the_classes_is_a_clear_error(script, tmp_path):
    with pytest.raises(SystemExit, match="CompletionRequest not found"):
        script.main([str(tmp_path)])
