"""A model's sampling defaults: generation_config.json in a folder, general.sampling.* in a GGUF header
(written here by the gguf package, as llama.cpp's converter writes them), and the default model's none."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from metrale.config import EngineConfig
from metrale.loading.default_model import default_model_path
from metrale.loading.generation_defaults import from_generation_config, read_sampling_defaults

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def test_generation_config_json_of_a_folder(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({**QWEN3, "min_p": 0.0,
                                                                 "repetition_penalty": 1.05}))
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                "repetition_penalty": 1.05}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_sampling_defaults(empty) == {}


def test_greedy_and_odd_values():
    assert from_generation_config({"do_sample": False, "temperature": 0.7, "top_p": 0.8}) == {"temperature": 0.0}
    # a value SamplingParams refuses is left out (logged), never a failed start
    assert from_generation_config({"temperature": -1.0, "top_p": 7, "top_k": 40, "min_p": "x"}) == {"top_k": 40}


def test_gguf_general_sampling_keys(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])  # arrays before and after are skipped
    writer.add_sampling_temp(0.7)
    writer.add_sampling_top_k(40)
    writer.add_sampling_top_p(0.9)
    writer.add_sampling_min_p(0.05)
    writer.add_sampling_penalty_repeat(1.1)
    writer.add_sampling_sequence("edkypmxt")
    writer.add_array("tokenizer.ggml.scores", [0.0, 1.0, 2.0])
    writer.add_tensor("token_embd.weight", np.zeros((3, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults = read_sampling_defaults(path)
    assert defaults == pytest.approx({"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
                                      "repetition_penalty": 1.1})
    assert isinstance(defaults["top_k"], int)


def test_the_default_model_ships_none_and_the_flag_is_checked():
    assert read_sampling_defaults(default_model_path()) == {}
    assert EngineConfig(generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ValueError, match="generation_config"):
        EngineConfig(generation_config="hf")
