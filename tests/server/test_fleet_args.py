"""`metrale fleet`'s command lines, without starting anything (the processes: test_fleet.py)."""

from __future__ import annotations

import argparse
import importlib.util
import socket

import pytest

from metrale.cli import build_parser
from metrale.server import fleet
from metrale.server.cli import add_serve_arguments


def fleet_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["fleet", *argv])


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    assert argv[0] == "serve"
    return parser.parse_args(argv[1:])


def test_replicas_get_every_serve_option_on_their_own_port():
    args = fleet_args("--port", "9000", "--host", "0.0.0.0", "--model", "/m/x.gguf", "--max-num-seqs", "8",
                      "--no-prefix-caching", "--served-model-name", "x", "--model-alias", "gpt-x",
                      "--shutdown-timeout", "12.5", "--replicas", "3", "--policy", "round_robin")
    argv = fleet.replica_argv(args, 41000)
    replica = serve_args(argv)
    assert (replica.host, replica.port) == ("127.0.0.1", 41000)
    assert (replica.model, replica.max_num_seqs, replica.no_prefix_caching) == ("/m/x.gguf", 8, True)
    assert (replica.served_model_name, replica.shutdown_timeout) == ("x", 12.5)
    assert replica.model_alias == ["gpt-x", "unknown"]  # the router's id for a chat without "model"
    assert "--replicas" not in argv and "--policy" not in argv


def test_defaults_are_not_repeated_and_the_alias_is_added_once():
    argv = fleet.replica_argv(fleet_args("--model-alias", "unknown"), 41000)
    assert argv == ["serve", "--host", "127.0.0.1", "--port", "41000", "--model-alias", "unknown",
                    "--vllm-metric-aliases"]
    assert fleet.replica_argv(fleet_args("--vllm-metric-aliases"), 41000).count("--vllm-metric-aliases") == 1


def test_replicas_serve_vllms_gauge_names_for_the_router():
    assert serve_args(fleet.replica_argv(fleet_args(), 41000)).vllm_metric_aliases
    assert not serve_args(["serve"]).vllm_metric_aliases  # off for a plain metrale serve


def test_the_api_key_travels_by_environment_not_argv():
    args = fleet_args("--api-key", "s3cret")
    assert "s3cret" not in " ".join(fleet.replica_command(args, 41000))
    assert "s3cret" not in " ".join(fleet.router_command(args, ["http://127.0.0.1:41000"], 42000))


def test_router_flags():
    args = fleet_args("--port", "9000", "--host", "0.0.0.0", "--shutdown-timeout", "20",
                      "--router-args", "--cb-failure-threshold 5 --balance-abs-threshold 8")
    argv = fleet.router_argv(args, ["http://127.0.0.1:1", "http://127.0.0.1:2"], 42000)
    value = lambda flag: argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # noqa: E731  (the last one wins)
    assert (value("--host"), value("--port"), value("--policy")) == ("0.0.0.0", "9000", "cache_aware")
    assert argv[argv.index("--worker-urls") + 1:argv.index("--worker-urls") + 3] == ["http://127.0.0.1:1",
                                                                                      "http://127.0.0.1:2"]
    assert (value("--prometheus-host"), value("--prometheus-port")) == ("127.0.0.1", "42000")
    assert value("--shutdown-grace-period-secs") == "25"  # outlives the replicas' drain
    assert value("--cb-failure-threshold") == "5"  # --router-args come last and override the defaults
    assert value("--balance-abs-threshold") == "8"
    assert value("--health-check-interval-secs") == "2"
    assert value("--request-timeout-secs") == "600"  # a total bound: streams included


def test_router_flags_parse_with_the_installed_router():
    launch = pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed")
    args = fleet_args("--router-args", "--cb-failure-threshold 5")
    parsed = launch.parse_router_args(fleet.router_argv(args, ["http://127.0.0.1:1"], 42000))
    assert parsed.policy == "cache_aware" and parsed.worker_urls == ["http://127.0.0.1:1"]
    assert (parsed.prometheus_port, parsed.cb_failure_threshold, parsed.health_check_interval_secs) == (42000, 5, 2)
    assert parsed.request_timeout_secs == 600


def test_a_taken_port_fails_before_anything_starts(capsys):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed: run_fleet stops before the port check")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert fleet.run_fleet(fleet_args("--port", str(taken.getsockname()[1]))) == 1
    assert "cannot listen on" in capsys.readouterr().err


def test_free_ports_are_distinct():
    ports = fleet.free_ports(5)
    assert len(set(ports)) == 5


@pytest.mark.parametrize("flags, message", [(("--hang-timeout", "0"), "hang_timeout_s must be > 0"),
                                            (("--max-restarts", "-1"), "max_restarts must be >= 0"),
                                            (("--request-timeout", "0"), "--request-timeout must be >= 1")])
def test_supervision_settings_that_cannot_work_are_refused(flags, message, capsys):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed: run_fleet stops before these checks")
    assert fleet.run_fleet(fleet_args(*flags)) == 2
    assert message in capsys.readouterr().err
