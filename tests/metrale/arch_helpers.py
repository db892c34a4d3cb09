"""Test helpers for the architectures and the folder loader: tiny configs of every family, random
weights written as a Hugging Face / MLX folder (config.json, safetensors, tokenizer.json), and
mlx-lm's own model and generation on the same folder as the reference."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kernels.runtime  # noqa: F401  (the OpenBLAS preload, before mlx)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402
from mlx_lm.utils import _get_classes, load as mlx_lm_load, quantize_model  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers  # noqa: E402

from tests.metrale.model_helpers import CHATML_TEMPLATE, CONTROL_TOKENS, TINY_LLAMA, tiny_vocab  # noqa: E402

GEMMA3_WINDOW = 8
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**TINY_LLAMA, "hidden_act": "silu"},
    "mistral": {**TINY_LLAMA, "model_type": "mistral", "tie_word_embeddings": False, "sliding_window": None},
    "qwen2": {
        **TINY_LLAMA, "model_type": "qwen2", "rope_theta": 1_000_000.0, "sliding_window": 32768,
        "use_sliding_window": False, "max_window_layers": 2,
    },
    "qwen3": {
        **TINY_LLAMA, "model_type": "qwen3", "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_theta": 1_000_000.0, "tie_word_embeddings": False, "sliding_window": None, "use_sliding_window": False,
    },
    "gemma3": {
        "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101,
        "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24,
        "sliding_window": GEMMA3_WINDOW, "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 256,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    },
    "gemma2": {
        "model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 101,
        "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 8.0, "sliding_window": 4096, "max_position_embeddings": 256,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    },
    "phi3": {
        **TINY_LLAMA, "model_type": "phi3", "tie_word_embeddings": False, "rope_scaling": None,
        "original_max_position_embeddings": 256, "sliding_window": None,
    },
    "ministral3": {
        **TINY_LLAMA, "model_type": "ministral3", "head_dim": 16, "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
        },
    },
    "qwen3_moe": {
        **TINY_LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "sliding_window": None,
        "use_sliding_window": False,
    },
    "mixtral": {
        **TINY_LLAMA, "model_type": "mixtral", "tie_word_embeddings": False, "num_local_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 32, "rope_theta": 1_000_000.0,
    },
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>",
    "chat_template": CHATML_TEMPLATE,
}


def reference_model(config_dict: Mapping[str, Any], seed: int = 0) -> Any:
    """mlx-lm's model of `config_dict` (mlx_lm.models.<model_type>) with random float32 weights,
    scaled up from mlx's defaults so that logits differ clearly between tokens."""
    mx.random.seed(seed)
    model_class, args_class = _get_classes(dict(config_dict))
    model = model_class(args_class.from_dict(dict(config_dict)))
    params = {
        name: value * 2.0 if value.ndim == 2 else value + 0.1 * mx.random.normal(value.shape)
        for name, value in tree_flatten(model.parameters())
        if not (config_dict.get("tie_word_embeddings") and name.startswith("lm_head."))
    }
    if hasattr(type(model), "sanitize"):  # gemma3's drops its lm_head (gemma2 has none)
        params = model.sanitize(params)
    model.load_weights(list(params.items()), strict=True)
    mx.eval(model.parameters())
    return model


def write_tokenizer(folder: Path, vocab_size: int, tokenizer_config: Mapping[str, Any] | None = None) -> None:
    """tokenizer.json (a tiny byte-level BPE with control tokens) and tokenizer_config.json."""
    tokens, merges = tiny_vocab(vocab_size)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(CONTROL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = TOKENIZER_CONFIG if tokenizer_config is None else tokenizer_config
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_folder(
    folder: Path, config_dict: Mapping[str, Any], params: Mapping[str, mx.array], *, shards: int = 1,
    tokenizer: bool = True,
) -> Path:
    """A model folder: config.json, the params as model.safetensors (or `shards` shards with an
    index, as Hugging Face writes them) and a tiny tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(config_dict)))
    names = sorted(params)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), dict(params), metadata={"format": "mlx"})
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: params[n] for n in names[i::shards]}
            mx.save_safetensors(str(folder / file), part, metadata={"format": "mlx"})
            weight_map.update(dict.fromkeys(part, file))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if tokenizer:
        write_tokenizer(folder, config_dict.get("vocab_size") or config_dict["text_config"]["vocab_size"])
    return folder


def arch_folder(tmp_path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A random tiny model folder of architecture `arch` (an ARCH_CONFIGS key)."""
    config_dict = {**ARCH_CONFIGS[arch], **overrides}
    model = reference_model(config_dict, seed)
    return write_folder(tmp_path / arch, config_dict, dict(tree_flatten(model.parameters())))


def quantized_folder(tmp_path: Path, arch: str, *, group_size: int = 32, bits: int = 4) -> Path:
    """A folder quantized with mlx-lm's own quantize_model (as mlx_lm.convert writes it): `bits`
    everywhere except layer 1's down_proj at 8 bits, recorded as a per-module override."""
    config_dict = dict(ARCH_CONFIGS[arch])
    model = reference_model(config_dict)

    def predicate(path: str, _module: Any) -> bool | dict[str, int]:
        return {"group_size": group_size, "bits": 8} if path == "model.layers.1.mlp.down_proj" else True

    model, config_dict = quantize_model(model, config_dict, group_size, bits, quant_predicate=predicate)
    return write_folder(tmp_path / f"{arch}-q{bits}", config_dict, dict(tree_flatten(model.parameters())))


def load_reference(folder: Path) -> tuple[Any, Any]:
    """(mlx-lm model, mlx-lm TokenizerWrapper) loaded from `folder` by mlx_lm.utils.load."""
    return mlx_lm_load(str(folder))


def reference_generate(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """mlx-lm's greedy stream_generate of `max_tokens` tokens after `prompt`, never stopping early."""
    tokenizer.eos_token_ids = set()  # metrale's side runs with ignore_eos
    return [r.token for r in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens)]


def random_prompts(vocab: int, lengths: Sequence[int], seed: int = 1) -> list[list[int]]:
    """Token-id prompts of the given lengths, avoiding the control tokens (ids 0..2)."""
    rng = random.Random(seed)
    return [[rng.randrange(len(CONTROL_TOKENS), vocab) for _ in range(n)] for n in lengths]
