"""The engine reads a model folder's generation_config.json sampling defaults at start (EngineConfig
generation_config "auto"), and ignores them with "vllm"."""

from __future__ import annotations

import json

import pytest

from metrale import AsyncEngine, EngineConfig
from tests.metrale.arch_helpers import arch_folder


@pytest.mark.parametrize(("mode", "expected"), [("auto", {"temperature": 0.6, "top_p": 0.95, "top_k": 20}),
                                                ("vllm", {})])
async def test_generation_config_defaults_at_start(tmp_path, mode, expected):
    folder = arch_folder(tmp_path, "qwen3")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0], "do_sample": True,
                                                               "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    async with AsyncEngine(EngineConfig(model=str(folder), kv_cache_bytes=16 << 20, generation_config=mode)) as engine:
        assert engine.sampling_defaults == expected
