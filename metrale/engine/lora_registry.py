"""LoraAdapters: the engine's registered LoRA adapters, name -> folder (the front-end's side).

Registering reads and checks the folder against the base model (metrale.models.lora_spec: its config and
its safetensors header, never its weights), so a bad folder is refused before any request uses it. A
request carries the adapter's LoraRef (name and folder) to the runner, which loads the weights when the
adapter is first scheduled (and again after an eviction), in this process or in the engine process.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from metrale.engine.ipc import ModelFacts
from metrale.errors import InvalidLoraAdapterError, LoraNotFoundError
from metrale.models.lora_spec import read_adapter
from scheduler import LoraRef

MAX_LORA_NAME_CHARS = 256


class LoraAdapters:
    """Registered adapters by name; `max_rank` bounds what `add` accepts, `max_adapters` how many are registered."""

    def __init__(self, facts: ModelFacts, max_rank: int, max_adapters: int) -> None:
        self._facts = facts
        self._max_rank = max_rank
        self._max_adapters = max_adapters
        self._refs: dict[str, LoraRef] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._refs

    def names(self) -> dict[str, str]:
        """Registered adapter name -> its folder."""
        return {name: ref.path for name, ref in self._refs.items()}

    def get(self, name: str) -> LoraRef:
        """The adapter registered as `name`; LoraNotFoundError otherwise."""
        ref = self._refs.get(name) if isinstance(name, str) else None
        if ref is None:
            raise LoraNotFoundError(f"LoRA adapter {name!r} is not loaded")
        return ref

    async def add(self, name: str, path: str) -> LoraRef:
        """Check the folder (on a worker thread: it reads files) and register it as `name`;
        InvalidLoraAdapterError for a bad name or folder, a name taken by another folder, or a full registry
        (checked before the folder is read, and again after)."""
        if not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME_CHARS or not isinstance(path, str):
            raise InvalidLoraAdapterError(f"a LoRA adapter needs a name of 1..{MAX_LORA_NAME_CHARS} characters "
                                          f"and a folder path, got {name!r}, {path!r}", field="lora_name")
        folder = str(Path(path).expanduser().resolve())
        existing = self._refs.get(name)
        if existing is not None:
            if existing.path == folder:
                return existing
            raise InvalidLoraAdapterError(f"LoRA adapter {name!r} is already loaded from {existing.path}; "
                                          "unload it first", field="lora_name")
        self._check_room()
        facts = self._facts
        try:
            await asyncio.to_thread(read_adapter, folder, facts.num_hidden_layers, facts.lora_targets, self._max_rank)
        except (ValueError, OSError) as error:
            raise InvalidLoraAdapterError(f"LoRA adapter {name!r}: {error}") from error
        if name in self._refs and self._refs[name].path != folder:  # registered meanwhile
            raise InvalidLoraAdapterError(f"LoRA adapter {name!r} is already loaded from {self._refs[name].path}",
                                          field="lora_name")
        if name not in self._refs:
            self._check_room()  # others registered while this folder was read
        ref = self._refs[name] = LoraRef(name, folder)
        return ref

    def _check_room(self) -> None:
        if len(self._refs) >= self._max_adapters:
            raise InvalidLoraAdapterError(f"at most {self._max_adapters} LoRA adapters are registered "
                                          f"(max_lora_adapters); unload one first", field="lora_name")

    def remove(self, name: str) -> bool:
        """Unregister `name` (requests already running with it finish with it); False if unknown."""
        return self._refs.pop(name, None) is not None
