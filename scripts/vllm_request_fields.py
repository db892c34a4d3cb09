"""Print the fields of vLLM's completion and chat request types that metrale's request structs do not declare.

    python scripts/vllm_request_fields.py /path/to/vllm-source     (a git checkout or an unpacked sdist)

vLLM's protocol files are read with `ast` (vLLM is never imported, so it need not be installable here). Each
name printed is a field a vLLM client may send that metrale would otherwise treat as unknown: declare it in
metrale/server/protocol.py and either honour it or refuse it in metrale/server/refusals.py (and list it in
tests/server/test_request_fields.py). Exits 1 when any is missing, 0 when metrale covers them all.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

# (endpoint, file under the vLLM source root, class): current layout first, the pre-2026 single file second
REQUEST_TYPES = (
    ("completions", ("vllm/entrypoints/openai/completion/protocol.py", "vllm/entrypoints/openai/protocol.py"),
     "CompletionRequest"),
    ("chat", ("vllm/entrypoints/openai/chat_completion/protocol.py", "vllm/entrypoints/openai/protocol.py"),
     "ChatCompletionRequest"),
)


def request_fields(source: str, class_name: str) -> list[str]:
    """The public annotated fields of `class_name` in a Python file's text, in order."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return [item.target.id for item in node.body
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                    and not item.target.id.startswith("_")]
    raise LookupError(f"class {class_name} not found")


def vllm_fields(root: Path) -> dict[str, list[str]]:
    """endpoint -> vLLM's request fields, read from the first of the known files that defines the class."""
    out = {}
    for endpoint, paths, class_name in REQUEST_TYPES:
        for relative in paths:
            path = root / relative
            if path.is_file():
                try:
                    out[endpoint] = request_fields(path.read_text(), class_name)
                    break
                except LookupError:
                    continue
        else:
            raise SystemExit(f"{class_name} not found under {root} (looked in {', '.join(paths)})")
    return out


def metrale_fields() -> dict[str, set[str]]:
    from metrale.server.protocol import ChatCompletionRequest, CompletionRequest

    return {"completions": set(CompletionRequest.__struct_fields__),
            "chat": set(ChatCompletionRequest.__struct_fields__)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vllm_root", type=Path, help="a vLLM source tree (the folder that holds vllm/)")
    args = parser.parse_args(argv)
    ours = metrale_fields()
    missing_any = False
    for endpoint, fields in vllm_fields(args.vllm_root).items():
        missing = [name for name in fields if name not in ours[endpoint]]
        missing_any = missing_any or bool(missing)
        print(f"{endpoint}: {len(fields)} vLLM fields, {len(missing)} not declared by metrale"
              + (": " + " ".join(missing) if missing else ""))
    return 1 if missing_any else 0


if __name__ == "__main__":
    sys.exit(main())
