"""One exposition from several engines': one HELP/TYPE per family, every sample kept, model_name relabelled."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metrale.engine.metrics import EngineMetrics
from metrale.manager.metrics import ManagerMetrics, merge_expositions, relabel


def _engine_exposition(label: str) -> bytes:
    metrics = EngineMetrics(model_name=label)
    metrics.record_rejected("queue_full")
    return generate_latest(metrics.registry)


def test_two_engines_with_one_file_stem_merge_under_their_ids():
    manager = ManagerMetrics()
    manager.register_models(["a", "b"])
    manager.loaded("a", "ok", 123)
    body = merge_expositions([manager.exposition(), relabel(_engine_exposition("same-stem"), "a"),
                              relabel(_engine_exposition("same-stem"), 'b"quoted')])
    text = body.decode()
    assert text.count("# HELP metrale_requests_running ") == 1 and text.count("# TYPE metrale_requests_running ") == 1
    rejected = {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "metrale_requests_rejected_total" and s.labels["reason"] == "queue_full"}
    assert rejected == {(("model_name", "a"), ("reason", "queue_full")): 1.0,
                        (("model_name", 'b"quoted'), ("reason", "queue_full")): 1.0}
    assert 'metrale_model_resident_bytes{model_name="a"} 123.0' in text
    if shutil.which("promtool") is not None:
        result = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("parts", [[], [b""]])
def test_nothing_merges_to_nothing(parts):
    assert merge_expositions(parts) == b""
