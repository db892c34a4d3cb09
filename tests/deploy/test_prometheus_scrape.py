"""A real Prometheus, started on loopback with deploy's scrape config (target and interval adjusted
for the test), ingests metrale_generation_tokens_total from a real `metrale serve`."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.server.serve import SMALL, ServerProcess, free_port

yaml = pytest.importorskip("yaml", reason="PyYAML not installed: cannot rewrite the scrape config")
PROMETHEUS = shutil.which("prometheus")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300),
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (Debian package "
                                 "`prometheus`; scripts/setup.sh installs it)")]


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_ingests_generation_tokens(tmp_path):
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    shutil.copy(DEPLOY / "prometheus/alerts.yml", tmp_path / "alerts.yml")
    with ServerProcess(*SMALL) as server:
        status, body = server.post_json("/v1/completions", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert status == 200
        config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{server.port}"]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        with (tmp_path / "prometheus.log").open("w") as log:
            prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline, result = time.monotonic() + 60, []
            while time.monotonic() < deadline and not result:
                time.sleep(0.5)
                try:
                    result = _query(port, 'metrale_generation_tokens_total{job="metrale"}')
                except OSError:
                    continue  # not listening yet
            assert result, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert float(result[0]["value"][1]) == 3.0
            assert result[0]["metric"]["service"] == "metrale"
            assert _query(port, 'up{job="metrale"}')[0]["value"][1] == "1"
        finally:
            prom.terminate()
            prom.wait(30)
