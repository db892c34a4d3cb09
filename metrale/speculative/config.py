"""SpeculativeConfig: how the engine speculates, in the shape vLLM users know.

    EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    EngineConfig(speculative_config={"method": "draft_model", "model": "path/to/small.gguf"})
    metrale serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup on the CPU) or "draft_model" (`model`, a smaller model with the
    same tokenizer). num_speculative_tokens: the most drafts per step. prompt_lookup_min/max: the
    n-gram sizes searched (longest first). disable_by_batch_size: no request speculates while more
    than this many run (at high load speculation costs throughput). adaptive: each request's draft
    count follows its recent acceptance."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    disable_by_batch_size: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {self.method!r}")
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("disable_by_batch_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"speculative_config.{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max must be an int >= prompt_lookup_min "
                             f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model is required with method 'draft_model' and only then")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From a config, a dict, a JSON object string, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)
