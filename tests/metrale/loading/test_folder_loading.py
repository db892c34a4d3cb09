"""Hugging Face / MLX model folders: float and quantized weights, shards, names, tokenizer files,
`load_model`'s dispatch (file, folder, hub id) and a clear error for every bad case."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from tests.metrale.arch_helpers import (
    ARCH_CONFIGS, arch_folder, load_reference, quantized_folder, random_prompts, reference_generate,
    reference_model, write_folder, write_tokenizer,
)
from tests.kernels.qmm_helpers import use_float_kernels
from tests.metrale.model_helpers import CHATML_TEMPLATE, PagedHarness, write_tiny_gguf

import mlx.core as mx  # noqa: E402  (the helpers load the fast BLAS first)
from mlx.utils import tree_flatten, tree_map  # noqa: E402

from metrale import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from metrale.loading import ModelNotFoundError, load_model  # noqa: E402
from metrale.loading import gguf as gguf_module  # noqa: E402
from metrale.loading import hub as hub_module  # noqa: E402
from metrale.text.chat_template import ChatTemplate  # noqa: E402
from kernels import ext  # noqa: E402
from kernels.qmm import QuantizedEmbeddingCPU, QuantizedLinearCPU  # noqa: E402

needs_qmm = pytest.mark.skipif(not ext.has_qmm_kernels(), reason="kernels not built: python -m kernels.build")

ATOL = 1e-4
PROMPTS = random_prompts(101, [21, 1, 13])


def _logits(loaded, prompts=PROMPTS):
    chunks = [(f"s{i}", p) for i, p in enumerate(prompts)]
    return PagedHarness(loaded.config).step(loaded.model, chunks)


def _assert_matches(loaded, reference, prompts=PROMPTS):
    for p, got in zip(prompts, _logits(loaded, prompts)):
        want = reference(mx.array([p]))[0]  # (L, vocab)
        assert mx.allclose(got, want, atol=ATOL, rtol=1e-4).item(), mx.abs(got - want).max().item()


def _params(arch="qwen3", **overrides):
    config = {**ARCH_CONFIGS[arch], **overrides}
    return config, dict(tree_flatten(reference_model(config).parameters()))


# -- weights ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_float_dtypes_load_as_float32_on_cpu(tmp_path, stored):
    config, params = _params(torch_dtype=stored)
    params = {n: v.astype(getattr(mx, stored)) for n, v in params.items()}
    folder = write_folder(tmp_path / stored, config, params)
    loaded = load_model(str(folder))
    assert loaded.dtype == mx.float32 and loaded.quantization == {}
    assert loaded.model.model.embed_tokens.weight.dtype == mx.float32
    reference, _ = load_reference(folder)
    reference.update(tree_map(lambda p: p.astype(mx.float32), reference.parameters()))  # same weights, float32
    _assert_matches(loaded, reference)


def test_sharded_folder_equals_single_file(tmp_path):
    config, params = _params("gemma3")
    single = load_model(str(write_folder(tmp_path / "one", config, params)))
    sharded_folder = write_folder(tmp_path / "three", config, params, shards=3)
    assert len(list(sharded_folder.glob("model-*.safetensors"))) == 3
    sharded = load_model(str(sharded_folder))
    for a, b in zip(_logits(single), _logits(sharded)):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."])
def test_multimodal_gemma3_layout_loads_its_text_model(tmp_path, layout):
    """Multimodal gemma3 checkpoints: text_config, prefixed names, a vision tower to drop."""
    config, params = _params("gemma3")
    plain = load_model(str(write_folder(tmp_path / "plain", config, params)))
    wrapped = {layout + n.removeprefix("model."): v for n, v in params.items()}
    wrapped["vision_tower.vision_model.post_layernorm.weight"] = mx.ones((8,))
    wrapped["model.multi_modal_projector.mm_soft_emb_norm.weight"] = mx.ones((8,))
    wrapped["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))  # an old RoPE buffer
    outer = {"model_type": "gemma3", "text_config": config, "vision_config": {"hidden_size": 8}}
    loaded = load_model(str(write_folder(tmp_path / "multimodal", outer, wrapped)))
    assert loaded.config == plain.config
    for a, b in zip(_logits(plain), _logits(loaded)):
        assert mx.array_equal(a, b).item()


def test_tied_checkpoint_with_an_lm_head_copy_loads(tmp_path):
    config, params = _params("llama")
    assert config["tie_word_embeddings"]
    params["lm_head.weight"] = params["model.embed_tokens.weight"]
    loaded = load_model(str(write_folder(tmp_path / "tied", config, params)))
    assert "lm_head" not in loaded.model


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def quantized(request, tmp_path_factory):
    return quantized_folder(tmp_path_factory.mktemp("quant"), request.param)


def test_quantized_folder_dequantized_with_a_cpu_dtype_matches_mlx_lm(quantized):
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization"]["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    loaded = load_model(str(quantized), dtype=mx.float32)  # --dtype float32: dequantized
    assert loaded.quantization == {} and loaded.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    reference, _ = load_reference(quantized)
    _assert_matches(loaded, reference)


@needs_qmm
def test_quantized_folder_runs_on_the_cpu_kernels_by_default(quantized, monkeypatch):
    loaded = load_model(str(quantized))
    assert len(loaded.quantization) == 7 * loaded.config.num_hidden_layers + 1 + (not loaded.config.tie_word_embeddings)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantizedLinearCPU) and "q_proj" not in layer.self_attn
    assert isinstance(layer.mlp.gate_up_proj, QuantizedLinearCPU) and layer.mlp.gate_up_proj.glu
    assert isinstance(loaded.model.model.embed_tokens, QuantizedEmbeddingCPU)
    reference, _ = load_reference(quantized)
    # int8 activations: within a fraction of the logits' spread, the same top token nearly everywhere
    for p, got in zip(PROMPTS, _logits(loaded)):
        want = reference(mx.array([p]))[0]  # (L, vocab)
        spread = mx.std(want).item()
        assert mx.abs(got - want).max().item() < 0.3 * spread
        assert mx.mean(mx.argmax(got, -1) == mx.argmax(want, -1)).item() >= 0.85
    use_float_kernels(monkeypatch)  # the same packed weights in float: the wiring is exact
    _assert_matches(loaded, reference)


def test_quantized_folder_kept_quantized_matches_mlx_lm(quantized, monkeypatch):
    monkeypatch.setenv("METRALE_MATMUL", "reference")  # MLX's quantized modules, as on a GPU
    loaded = load_model(str(quantized), keep_quantized=True)
    q, c = loaded.quantization, loaded.config
    assert q["model.layers.1.mlp.down_proj"] == {"group_size": 32, "bits": 8}
    assert q["model.layers.0.mlp.down_proj"] == q["model.embed_tokens"] == {"group_size": 32, "bits": 4}
    # every linear of every layer, the embedding, and the lm_head unless tied
    assert len(q) == 7 * c.num_hidden_layers + 1 + (not c.tie_word_embeddings)
    reference, _ = load_reference(quantized)
    _assert_matches(loaded, reference)


async def test_quantized_folder_generates_what_mlx_lm_generates(quantized):
    reference, ref_tokenizer = load_reference(quantized)
    want = [reference_generate(reference, ref_tokenizer, p, 16) for p in PROMPTS]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # float32: greedy tokens of tiny random models are too close for int8 activations to match exactly
    config = EngineConfig(model=str(quantized), dtype="float32", kv_cache_bytes=4 << 20, block_size=4,
                          max_num_seqs=8)
    async with AsyncEngine(config) as engine:
        results = await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS))
    assert [r.token_ids for r in results] == want


# -- tokenizer files --------------------------------------------------------------------------------


def test_tokenizer_chat_template_and_eos_ids_from_the_folder(tmp_path):
    folder = arch_folder(tmp_path, "qwen3")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    loaded = load_model(str(folder))
    _, ref_tokenizer = load_reference(folder)
    tok = loaded.tokenizer
    assert tok.chat_template == CHATML_TEMPLATE and tok.bos_token == "<|im_start|>"
    assert set(tok.eos_token_ids) == set(ref_tokenizer.eos_token_ids) == {0, 2}
    text = "<|im_start|>hello world<|im_end|>"
    assert tok.encode(text) == ref_tokenizer.encode(text)
    rendered = ChatTemplate.for_tokenizer(loaded.tokenizer, loaded.config.architecture).render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_from_chat_template_json(tmp_path):
    config, params = _params()
    folder = write_folder(tmp_path / "m", config, params, tokenizer=False)
    write_tokenizer(folder, config["vocab_size"], {"eos_token": "<|im_end|>"})
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE}))
    assert load_model(str(folder)).tokenizer.chat_template == CHATML_TEMPLATE


# -- load_model dispatch ----------------------------------------------------------------------------


def test_dispatch_gguf_file_and_default(tmp_path, monkeypatch):
    config, params = _params("llama")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(str(path), config, list(params.items()))
    assert load_model(str(path)).path == path
    calls = []
    monkeypatch.setattr(gguf_module, "load_gguf", lambda p, **kw: calls.append((p, kw)) or "default")
    assert load_model(None, dtype=mx.float16) == "default"
    assert calls == [(None, {"dtype": mx.float16, "keep_quantized": None, "shard": None})]


def _fake_hub_cache(cache, repo_id, source):
    """The layout huggingface_hub's cache has: models--org--name/{refs/main, snapshots/<commit>/...}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(source, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen3", arch_folder(tmp_path, "qwen3"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_model("tiny-org/tiny-qwen3")
    assert loaded.path == snapshot and loaded.config.architecture == "qwen3"


def test_hub_id_missing_offline_names_the_id_and_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    message = f"hub model tiny-org/absent is not in the local cache {tmp_path / 'hub'}.*HF_HUB_OFFLINE"
    with pytest.raises(ModelNotFoundError, match=message):
        load_model("tiny-org/absent")


def test_hub_id_missing_and_unreachable(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    def unreachable(repo_id, **kwargs):
        raise LocalEntryNotFoundError("no connection")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match=r"tiny-org/absent is neither in the local cache .* nor downloadable"):
        load_model("tiny-org/absent")


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setattr(hub_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="huggingface_hub is not installed"):
        load_model("tiny-org/absent")


# -- errors -----------------------------------------------------------------------------------------


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_unsupported_architecture_lists_the_supported(tmp_path):
    folder = arch_folder(tmp_path, "llama")
    _edit_config(folder, model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"unsupported model architecture 'gpt_neox' in .*config.json; "
                                         r"supported: gemma2, gemma3, gemma3_text, llama, ministral3, mistral, mixtral, phi3, qwen2, qwen3, "
                                         r"qwen3_moe"):
        load_model(str(folder))


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("config.json", "no config.json in model folder"),
        ("model.safetensors", r"no weights in model folder .*: looked for model.safetensors.index.json, "
                              r"model\*.safetensors and \*.safetensors"),
        ("tokenizer.json", r"no tokenizer.json in model folder .* \(found: tokenizer_config.json\)"),
    ],
)
def test_missing_files_are_named(tmp_path, remove, message):
    folder = arch_folder(tmp_path, "llama")
    (folder / remove).unlink()
    with pytest.raises(ModelNotFoundError, match=message):
        load_model(str(folder))


def test_missing_shard_is_named(tmp_path):
    config, params = _params()
    folder = write_folder(tmp_path / "m", config, params, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"\['model-00002-of-00002.safetensors'\] are missing"):
        load_model(str(folder))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"intermediate_size": 128}, r"Expected shape \(128, 64\) but received shape \(96, 64\) for parameter "
                                     r"model.layers.0.mlp.gate_proj.weight: the weights do not match the config"),
        ({"num_hidden_layers": 3}, r"weights missing for the config \(qwen3: .*3 layers.*\): model.layers.2"),
        ({"num_hidden_layers": 1}, r"unexpected weights for the config .*: model.layers.1.input_layernorm.weight"),
        ({"model_type": "llama"}, r"unexpected weights .*: model.layers.0.self_attn.k_norm.weight"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq' is not supported"),
        ({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "mode 'mxfp4' is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn rope_scaling needs original_max_position"),
    ],
)
def test_configs_that_do_not_fit_the_weights(tmp_path, change, message):
    folder = arch_folder(tmp_path, "qwen3")
    _edit_config(folder, **change)
    with pytest.raises(ValueError, match=message):
        load_model(str(folder))


def test_quantization_entry_that_does_not_fit_its_tensors(tmp_path, quantized):
    folder = shutil.copytree(quantized, tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["model.layers.1.mlp.down_proj"] = {"group_size": 64, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj: the config's quantization .* does not fit"):
        load_model(str(folder))


def test_bad_paths(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="is not a model: give a .gguf file, a model folder or a hub id"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="no model file or folder at"):
        load_model(str(tmp_path / "absent" / "model.gguf"))
    folder = arch_folder(tmp_path, "llama")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_model(str(folder))
