"""PoolingParams: the per-request knobs of an embedding request, validated once at construction.

    normalize               L2-normalise the pooled vector (default True, as vLLM's embed pooler)
    dimensions              keep the first k dimensions, then normalise (Matryoshka truncation); only for
                            models that were trained for it (EngineConfig.matryoshka), checked at submit
    truncate_prompt_tokens  keep k tokens of a longer input; -1 is the most an input may hold
                            (max_model_len - 1); None refuses a too-long input
    truncation_side         which end truncation cuts: "left" keeps the last tokens (vLLM's, the default),
                            "right" keeps the first ones (Ollama's `truncate`)

How the vector is pooled (last token, mean, first token) is the engine's (EngineConfig.pooling): a property
of the model, not of the request.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from scheduler.errors import InvalidParamsError

POOLING_TYPES = ("last", "mean", "cls")
MAX_EMBED_INPUTS = 2048  # inputs in one embedding request (OpenAI's limit)


class PoolingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """See the module docstring. Invalid values raise InvalidParamsError naming the field."""

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise InvalidParamsError(f"normalize must be a bool, got {self.normalize!r}", field="normalize")
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise InvalidParamsError(f"dimensions must be an int >= 1, got {self.dimensions!r}", field="dimensions")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (type(truncate) is not int or (truncate < 1 and truncate != -1)):
            raise InvalidParamsError(f"truncate_prompt_tokens must be -1 or an int >= 1, got {truncate!r}",
                                     field="truncate_prompt_tokens")
        if self.truncation_side not in ("left", "right"):
            raise InvalidParamsError(f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}",
                                     field="truncation_side")
