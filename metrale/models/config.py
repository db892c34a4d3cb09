"""Model hyperparameters: one frozen, validated record per loaded model.

`ModelConfig` is what a model class is built from. Loaders fill it from GGUF metadata
(`metrale.loading.gguf`) or from a Hugging Face `config.json` (`ModelConfig.from_hf_dict`).
Nothing here imports mlx.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. "linear" divides positions by `factor`; "llama3" rescales the
    low frequencies as Llama 3.1 does (`low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3":
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                    f"{self.high_freq_factor} <= {self.low_freq_factor}"
                )
            if self.original_max_position_embeddings <= 0:
                raise ValueError(
                    f"original_max_position_embeddings must be > 0, got {self.original_max_position_embeddings}"
                )

    @classmethod
    def from_hf_dict(cls, scaling: Mapping[str, Any] | None) -> RopeScaling | None:
        """Build from a config.json `rope_scaling` entry (keys `type` or `rope_type`); None stays None."""
        if scaling is None:
            return None
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return None
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
        return cls(rope_type=rope_type, **{k: v for k, v in scaling.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only transformer.

    `architecture` names the model class in `metrale.models.MODEL_ARCHITECTURES`. `head_dim`
    defaults to hidden_size // num_attention_heads when left at 0. `rope_traditional` selects
    interleaved (GPT-J) RoPE; loaders give weights in the half-split (Hugging Face) layout, so
    it is normally False. `sliding_window` (Mistral) limits attention to the last `window`
    positions on every layer.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be None or > 0, got {self.sliding_window}")
        if self.rope_freq_factors is not None:
            if len(self.rope_freq_factors) != self.head_dim // 2 or not all(f > 0 for f in self.rope_freq_factors):
                raise ValueError(
                    f"rope_freq_factors must be {self.head_dim // 2} positive numbers (head_dim // 2), "
                    f"got {len(self.rope_freq_factors)}"
                )
            if self.rope_scaling is not None:
                raise ValueError("give rope_scaling or rope_freq_factors, not both")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")

    @classmethod
    def from_hf_dict(cls, config: Mapping[str, Any], architecture: str | None = None) -> ModelConfig:
        """Build from a Hugging Face / mlx-lm `config.json` mapping (unknown keys are ignored).

        RoPE settings come from `rope_theta` / `rope_scaling`, or from the newer `rope_parameters`."""
        rope = dict(config.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
        rope_scaling = rope if rope else config.get("rope_scaling")
        try:
            hidden = config["hidden_size"]
            heads = config["num_attention_heads"]
            return cls(
                architecture=architecture or config["model_type"],
                vocab_size=config["vocab_size"],
                hidden_size=hidden,
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=config.get("num_key_value_heads") or heads,
                intermediate_size=config["intermediate_size"],
                head_dim=config.get("head_dim") or 0,
                rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                rope_theta=rope_theta,
                rope_traditional=config.get("rope_traditional", False),
                rope_scaling=RopeScaling.from_hf_dict(rope_scaling),
                max_position_embeddings=config.get("max_position_embeddings") or 4096,
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                attention_bias=config.get("attention_bias", False),
                mlp_bias=config.get("mlp_bias", False),
                sliding_window=config.get("sliding_window"),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing required key {e.args[0]!r}") from None
