"""Model hyperparameters: one frozen, validated record per loaded model.

`ModelConfig` is what a model class is built from. Loaders fill it from GGUF metadata
(`metrale.loading.gguf`) or from a Hugging Face `config.json` (`ModelConfig.from_hf_dict`).
Nothing here imports mlx.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")

# Hugging Face's defaults for keys a gemma3 config.json may leave out (Gemma3TextConfig): the
# multimodal checkpoints' text_config is sparse (4B lists only a handful of keys).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
        "max_position_embeddings": 131072, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
    },
}
_HF_DEFAULTS["gemma3"] = _HF_DEFAULTS["gemma3_text"]
# Gemma2Config: even layers slide (Hugging Face's layer_types), GeGLU
_HF_DEFAULTS["gemma2"] = {"sliding_window_pattern": 2, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. "linear" divides positions by `factor`; "llama3" rescales the
    low frequencies as Llama 3.1 does (`low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`); "yarn" interpolates between the original and the scaled
    frequencies over the dims between `beta_fast` and `beta_slow` rotations, and scales q and k by
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (mscale(s, m) = 0.1 m ln s + 1; 1 for m 0),
    as Hugging Face, mlx-lm and llama.cpp do."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

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
        values = {k: v for k, v in scaling.items() if k in fields and v is not None}
        if rope_type == "yarn" and "original_max_position_embeddings" not in scaling:
            raise ValueError("yarn rope_scaling needs original_max_position_embeddings")
        return cls(rope_type=rope_type, **values)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only transformer.

    `architecture` names the model class in `metrale.models.MODEL_ARCHITECTURES`. `head_dim`
    defaults to hidden_size // num_attention_heads when left at 0. `rope_traditional` selects
    interleaved (GPT-J) RoPE; loaders give weights in the half-split (Hugging Face) layout, so
    it is normally False.

    Sliding windows: with `layer_types` None, `sliding_window` (Mistral) limits attention to the
    last `window` positions on every layer; with `layer_types` (one "full_attention" or
    "sliding_attention" per layer, gemma3) only the sliding layers are limited, and they rotate
    with base `rope_local_theta` (unscaled) when it is set. `query_pre_attn_scalar` sets the
    attention scale to its inverse square root (default head_dim ** -0.5).
    `final_logit_softcapping` c maps logits to c * tanh(logits / c); `attn_logit_softcapping` does
    the same to attention scores (gemma2).

    Mixture of experts (qwen3_moe, mixtral): `num_experts` > 0 makes every layer's MLP a routed block
    of `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` chosen per token, their
    weights renormalized when `norm_topk_prob`.

    `attn_temperature_scale` b (Mistral 3's llama_4_scaling_beta): queries at position p are scaled by
    1 + b * ln(1 + floor(p / attn_temperature_length)).
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
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_act: str = "silu"
    attn_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    attn_temperature_scale: float | None = None
    attn_temperature_length: int = 0

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
        self._check_layers_and_extras()

    def _check_layers_and_extras(self) -> None:
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
                )
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown} are not supported; supported: {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"an MoE config needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0, "
                    f"got {self.num_experts_per_tok} of {self.num_experts} experts of {self.moe_intermediate_size}"
                )
        if self.attn_temperature_scale is not None and self.attn_temperature_length <= 0:
            raise ValueError(f"attn_temperature_length must be > 0, got {self.attn_temperature_length}")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be None or > 0, got {value}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported; supported: {HIDDEN_ACTS}")

    def is_sliding_layer(self, layer_index: int) -> bool:
        """Whether layer `layer_index` attends over a sliding window."""
        if self.layer_types is None:
            return self.sliding_window is not None
        return self.layer_types[layer_index] == "sliding_attention"

    def layer_sliding_window(self, layer_index: int) -> int | None:
        """The attention window of layer `layer_index`, or None for full attention."""
        return self.sliding_window if self.is_sliding_layer(layer_index) else None

    @property
    def attention_scale(self) -> float:
        """The softmax scale of attention scores: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_dict(cls, config: Mapping[str, Any], architecture: str | None = None) -> ModelConfig:
        """Build from a Hugging Face / mlx-lm `config.json` mapping (unknown keys are ignored).

        RoPE settings come from `rope_theta` / `rope_scaling`, or from the newer `rope_parameters`
        (flat, or one entry per layer type as gemma3 writes it). A window is dropped when
        `use_sliding_window` is false (Qwen); gemma3's `sliding_window_pattern` becomes `layer_types`.
        Keys a gemma3 config leaves out take Hugging Face's defaults."""
        config = {**_HF_DEFAULTS.get(config.get("model_type", ""), {}), **config}
        try:
            heads = config["num_attention_heads"]
            return cls(
                architecture=architecture or config["model_type"],
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                num_hidden_layers=config["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=config.get("num_key_value_heads") or heads,
                intermediate_size=config["intermediate_size"],
                head_dim=config.get("head_dim") or 0,
                rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                rope_traditional=config.get("rope_traditional", False),
                max_position_embeddings=config.get("max_position_embeddings") or 4096,
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                attention_bias=config.get("attention_bias", False),
                mlp_bias=config.get("mlp_bias", False),
                query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
                final_logit_softcapping=config.get("final_logit_softcapping"),
                hidden_act=config.get("hidden_activation") or config.get("hidden_act") or "silu",
                attn_logit_softcapping=config.get("attn_logit_softcapping"),
                **_hf_experts(config),
                **_hf_rope(config),
                **_hf_windows(config),
            )
        except KeyError as e:
            raise ValueError(f"model config is missing required key {e.args[0]!r}") from None


def _hf_experts(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields from a config.json mapping (Qwen3-MoE's num_experts, Mixtral's num_local_experts)."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    if not experts:
        return {}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("MoE configs with dense layers (mlp_only_layers, decoder_sparse_step != 1) are not supported")
    return {
        "num_experts": experts, "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config.get("moe_intermediate_size") or config["intermediate_size"],
        "norm_topk_prob": config.get("norm_topk_prob", config.get("model_type") == "mixtral"),
    }


def _hf_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling and rope_local_theta from a config.json mapping."""
    rope = dict(config.get("rope_parameters") or {})
    local = config.get("rope_local_base_freq")
    if "full_attention" in rope:  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
        sliding = dict(rope.get("sliding_attention") or {})
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"scaled RoPE on sliding layers ({sliding['rope_type']!r}) is not supported")
        local = sliding.get("rope_theta", local)
        rope = dict(rope["full_attention"])
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    scaling = rope if rope else config.get("rope_scaling")
    fields = {"rope_theta": theta, "rope_scaling": RopeScaling.from_hf_dict(scaling), "rope_local_theta": local}
    beta = (scaling or {}).get("llama_4_scaling_beta")
    if beta:  # Ministral 3: queries scaled by position (ModelConfig.attn_temperature_scale)
        fields.update(attn_temperature_scale=float(beta),
                      attn_temperature_length=int(scaling["original_max_position_embeddings"]))
    return fields


def _hf_windows(config: Mapping[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types from a config.json mapping."""
    window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    num_layers = config["num_hidden_layers"]
    if config.get("use_sliding_window") is False:  # Qwen: the window is written down but off
        return {"sliding_window": None, "layer_types": None}
    if config.get("use_sliding_window") and layer_types is None:  # Qwen: the layers from max_window_layers
        first = config.get("max_window_layers", 0)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    pattern = config.get("sliding_window_pattern")
    if layer_types is None and pattern:  # gemma3: every pattern-th layer is global
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return {"sliding_window": window, "layer_types": None if layer_types is None else tuple(layer_types)}
