"""LoRA adapters over HTTP, as vLLM serves them.

    --lora-modules NAME=PATH | '{"name": ..., "path": ..., "base_model_name": ...}'   (repeatable)
        registered when the engine has started; a folder that does not fit the model stops the server
    GET  /v1/models                   each adapter is a model: {"id": NAME, "root": PATH, "parent": <base model>}
                                      (resolve.SingleModel.listing)
    POST /v1/load_lora_adapter        {"lora_name", "lora_path"}  -> 200 "Success: LoRA adapter 'x' added successfully."
    POST /v1/unload_lora_adapter      {"lora_name"}               -> 200 "Success: LoRA adapter 'x' removed successfully."

A request's `"model": NAME` runs the base model with that adapter (resolve.py: Target.adapter). The two
runtime routes exist only with `--enable-runtime-lora-updating` (vLLM gates them behind
VLLM_ALLOW_RUNTIME_LORA_UPDATING): they make the server read a folder a client names, so whoever may call
them can probe the server's file system through the error messages; an operator turns them on knowingly,
and with an API key set they need it like every other route. Errors follow vLLM's: 400 when a field is
missing, the name is taken or the folder does not fit the model; 404 to unload an unknown adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from metrale.errors import InvalidLoraAdapterError
from metrale.server import protocol
from metrale.server.asgi import Send, send_bytes
from metrale.server.errors import APIError, bad_request

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PATHS = (LOAD_PATH, UNLOAD_PATH)
_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]


@dataclass(frozen=True, slots=True)
class LoraModule:
    """An adapter the server registers at start: `base_model_name`, when given, must be the served model."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """`NAME=PATH` or vLLM's JSON form {"name", "path", "base_model_name"?}; ValueError otherwise."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {text!r}: bad JSON: {error}") from error
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str) \
                or not isinstance(spec.get("base_model_name", ""), (str, type(None))) \
                or set(spec) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules {text!r}: expected {{\"name\": str, \"path\": str, "
                             "\"base_model_name\": str (optional)}")
        return LoraModule(spec["name"], spec["path"], spec.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH or a JSON object")
    return LoraModule(name, path)


async def register(engine: Any, modules: tuple[LoraModule, ...], served_model: str) -> None:
    """Register the startup adapters; ValueError naming the first that does not fit."""
    for module in modules:
        if module.base_model_name is not None and module.base_model_name != served_model:
            raise ValueError(f"LoRA adapter {module.name!r} is for base model {module.base_model_name!r}; "
                             f"this server serves {served_model!r}")
        await engine.add_lora(module.name, module.path)


class LoadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=False):
    lora_name: str | None = None
    lora_int_id: int | None = None  # vLLM's; adapters are known here by name only


async def handle(engine: Any, path: str, body: bytes, send: Send) -> None:
    """One load or unload request (the caller checked the flag, the method and the API key)."""
    if path == LOAD_PATH:
        request = protocol.decode(body, LoadLoraAdapterRequest)
        name, folder = request.lora_name, request.lora_path
        if not name or not folder:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
        if name in engine.list_loras():
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="lora_already_loaded")
        try:
            await engine.add_lora(name, folder)
        except InvalidLoraAdapterError as error:
            raise APIError(400, str(error), param=error.field, code=error.code) from error
        return await send_bytes(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(), _TEXT)
    request = protocol.decode(body, UnloadLoraAdapterRequest)
    name = request.lora_name
    if not name:
        raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    if not engine.remove_lora(name):
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found")
    await send_bytes(send, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(), _TEXT)
