"""deploy/ is checked by the tools that will consume it: promtool, YAML/JSON/plist parsers, and the
`metrale serve` argument parser itself (so a renamed flag breaks here, not in production)."""

from __future__ import annotations

import argparse
import configparser
import json
import plistlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from metrale.engine.metrics import EngineMetrics
from metrale.server.cli import add_serve_arguments

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian package "
                                    "`prometheus`; scripts/setup.sh installs it)")
yaml = pytest.importorskip("yaml", reason="PyYAML not installed: YAML manifests not checked")
METRIC = re.compile(r"\bmetrale_[a-z0-9_]+")


def _sample_names() -> set[str]:
    """Every series a started engine exports (the length histograms appear at start)."""
    metrics = EngineMetrics()
    metrics.set_max_model_len(8192)
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def _metric_names(text: str) -> set[str]:
    return set(METRIC.findall(text))


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    assert argv[0] == "serve", argv
    return parser.parse_args(argv[1:])


def _yaml_docs(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def _router_args(argv: list[str]) -> dict:
    """sglang-router's flags as {flag: [values]} (the last occurrence wins), checked by the installed
    router's own parser when it is there."""
    try:
        from sglang_router.launch_router import parse_router_args
    except ImportError:
        pass  # metrale[router] not installed: the structural checks below still run
    else:
        parse_router_args(argv)
    flags: dict[str, list[str]] = {}
    for token in argv:
        if token.startswith("--"):
            current = flags[token] = []
        else:
            current.append(token)
    return flags


@needs_promtool
@pytest.mark.parametrize("args", [
    ["check", "config", "prometheus/prometheus.yml"],
    ["check", "config", "prometheus/prometheus-fleet.yml"],
    ["check", "rules", "prometheus/alerts.yml"],
    ["test", "rules", "prometheus/alerts_test.yml"],
])
def test_promtool_accepts(args):
    result = subprocess.run([PROMTOOL, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_scrape_config_targets_metrale_on_loopback():
    config = _yaml_docs("prometheus/prometheus.yml")[0]
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]


def test_every_metric_used_by_dashboard_alerts_and_hpa_exists():
    known = _sample_names()
    dashboard = json.loads((DEPLOY / "grafana/metrale-dashboard.json").read_text())
    assert dashboard["panels"] and dashboard["uid"] == "metrale-overview"
    used: set[str] = set()
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        assert exprs, panel["title"]
        for expr in exprs:
            assert expr.count("(") == expr.count(")"), expr
            used |= _metric_names(expr)
    for var in dashboard["templating"]["list"]:
        used |= _metric_names(json.dumps(var))
    for name in ("prometheus/alerts.yml", "k8s/hpa.yaml", "k8s/prometheus-adapter-values.yaml"):
        used |= _metric_names((DEPLOY / name).read_text())
    assert used - known == set()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "end-to-end", "throughput", "scheduler", "kv cache",
                  "finish", "queue", "preemption"):
        assert topic in titles


def test_kubernetes_manifests():
    docs = {(d["kind"], d["metadata"]["name"]): d for f in ("deployment.yaml", "service.yaml",
            "servicemonitor.yaml", "hpa.yaml", "router.yaml") for d in _yaml_docs(f"k8s/{f}")}
    pod = docs[("Deployment", "metrale")]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    args = _serve_args(container["args"])
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pre_stop_s + args.shutdown_timeout
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    service = docs[("Service", "metrale")]["spec"]
    monitor = docs[("ServiceMonitor", "metrale")]["spec"]
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["ports"]}
    assert service["selector"] == monitor["selector"]["matchLabels"]
    hpa = docs[("HorizontalPodAutoscaler", "metrale")]["spec"]
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "metrale_requests_waiting"
    adapter = _yaml_docs("k8s/prometheus-adapter-values.yaml")[0]
    assert "metrale_requests_waiting" in {r["name"]["as"] for r in adapter["rules"]["custom"]}
    kustomization = _yaml_docs("k8s/kustomization.yaml")[0]
    assert all((DEPLOY / "k8s" / r).is_file() for r in kustomization["resources"])
    assert "router.yaml" in kustomization["resources"]


def test_kubernetes_router_discovers_the_metrale_pods():
    docs = {(d["kind"], d["metadata"]["name"]): d for f in ("deployment.yaml", "hpa.yaml", "router.yaml")
            for d in _yaml_docs(f"k8s/{f}")}
    metrale = docs[("Deployment", "metrale")]["spec"]["template"]
    (replica,) = metrale["spec"]["containers"]
    assert "unknown" in _serve_args(replica["args"]).model_alias  # the router's id for a chat without model
    router = docs[("Deployment", "metrale-router")]["spec"]["template"]
    (container,) = router["spec"]["containers"]
    argv = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    flags = _router_args(argv)
    assert "--service-discovery" in flags and flags["--policy"] == ["cache_aware"]
    selector = dict(item.split("=", 1) for item in flags["--selector"])
    assert selector.items() <= metrale["metadata"]["labels"].items()  # finds the metrale pods...
    assert not selector.items() <= router["metadata"]["labels"].items()  # ...and not itself
    assert flags["--service-discovery-port"] == [str(replica["ports"][0]["containerPort"])]
    assert flags["--service-discovery-namespace"] == ["default"]
    assert {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} \
        in container["env"]
    # the router probes the pods with the key they check (metrale.router_main reads it from the environment)
    assert container["command"] == ["python", "-m", "metrale.router_main"]
    (replica_key,) = [e for e in replica["env"] if e["name"] == "METRALE_API_KEY"]
    assert replica_key in container["env"]
    assert int(flags["--cb-failure-threshold"][0]) < 5  # opens before a request's 5 attempts are spent
    assert int(flags["--shutdown-grace-period-secs"][0]) > _serve_args(replica["args"]).shutdown_timeout
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"  # /health is 200 with no workers
    (rule,) = docs[("Role", "metrale-router")]["rules"]
    assert rule["resources"] == ["pods"] and sorted(rule["verbs"]) == ["get", "list", "watch"]
    binding = docs[("RoleBinding", "metrale-router")]
    assert binding["roleRef"]["name"] == "metrale-router"
    assert binding["subjects"][0]["name"] == router["spec"]["serviceAccountName"]
    assert ("ServiceAccount", router["spec"]["serviceAccountName"]) in docs
    service = docs[("Service", "metrale-router")]["spec"]
    assert service["selector"].items() <= router["metadata"]["labels"].items()
    assert docs[("HorizontalPodAutoscaler", "metrale")]["spec"]["scaleTargetRef"]["name"] == "metrale"


def test_docker_compose():
    compose = _yaml_docs("docker-compose.yml")[0]
    services = compose["services"]
    assert set(services) == {"metrale", "prometheus", "grafana"}
    args = _serve_args(services["metrale"]["command"])
    assert int(services["metrale"]["stop_grace_period"].rstrip("s")) > args.shutdown_timeout
    assert (DEPLOY / services["metrale"]["build"]["dockerfile"].removeprefix("deploy/")).is_file()
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
    dockerfile = (DEPLOY / "docker/Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    _serve_args(cmd)


def test_docker_compose_fleet():
    compose = _yaml_docs("docker-compose.fleet.yml")[0]
    services = compose["services"]
    assert set(services) == {"metrale-0", "metrale-1", "router", "prometheus", "grafana"}
    replicas = {name: _serve_args(services[name]["command"]) for name in ("metrale-0", "metrale-1")}
    for name, args in replicas.items():
        assert "unknown" in args.model_alias
        assert int(services[name]["stop_grace_period"].rstrip("s")) > args.shutdown_timeout
        assert f"127.0.0.1:{args.port}/health" in " ".join(services[name]["healthcheck"]["test"])
    router = services["router"]
    assert router["entrypoint"] == ["python", "-m", "metrale.router_main"]
    assert router["environment"]["METRALE_API_KEY"] == services["metrale-0"]["environment"]["METRALE_API_KEY"]
    flags = _router_args(router["command"])
    assert flags["--worker-urls"] == [f"http://{a.host}:{a.port}" for a in replicas.values()]
    assert flags["--policy"] == ["cache_aware"] and flags["--prometheus-host"] == ["127.0.0.1"]
    assert int(flags["--shutdown-grace-period-secs"][0]) > max(a.shutdown_timeout for a in replicas.values())
    assert set(router["depends_on"]) == set(replicas)
    scrape = _yaml_docs("prometheus/prometheus-fleet.yml")[0]["scrape_configs"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in scrape}
    assert targets == {"metrale": [f"{a.host}:{a.port}" for a in replicas.values()],
                       "sglang-router": [f"127.0.0.1:{flags['--prometheus-port'][0]}"]}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source


def test_dockerfile_copies_every_package_and_builds_the_kernels():
    """The image holds every package pyproject installs and compiles the CPU kernels (portable)."""
    dockerfile = (DEPLOY / "docker/Dockerfile").read_text()
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    packages = re.search(r'include = \[(.*?)\]', pyproject).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), package
    assert "python -m kernels.build" in dockerfile and "march=native" not in dockerfile


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(DEPLOY / "systemd/metrale.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/metrale")
    args = _serve_args([a for a in argv[1:] if a != "$METRALE_ARGS"])
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert int(service["TimeoutStopSec"]) > args.shutdown_timeout
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_launchd_plist():
    plist = plistlib.loads((DEPLOY / "launchd/io.metrale.serve.plist").read_bytes())
    assert plist["Label"] == "io.metrale.serve" and plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restart on crash, not after a drain
    args = _serve_args(plist["ProgramArguments"][1:])
    assert plist["ExitTimeOut"] > args.shutdown_timeout
    assert plist["StandardOutPath"] and plist["StandardErrorPath"]


def test_readme_has_a_section_per_target():
    headings = [line.lower() for line in (DEPLOY / "README.md").read_text().splitlines() if line.startswith("## ")]
    for target in ("prometheus", "grafana", "docker", "systemd", "launchd", "kubernetes", "router"):
        assert any(target in h for h in headings), target
