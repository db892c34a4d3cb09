"""`metrale serve` flags: they parse, map onto EngineConfig, and the lead's `metrale` command has them."""

from __future__ import annotations

import argparse

import pytest

from metrale.config import EngineConfig
from metrale.settings import RuntimeSettings
from metrale.server.cli import SERVE_MAX_STEP_FACTOR, add_serve_parser, engine_config


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_defaults_are_the_engine_defaults_on_loopback():
    args = _parse()
    # the server's differences: an engine process, and a step limit that keeps streams going beside long prompts
    assert engine_config(args) == EngineConfig(engine_process=True, max_step_factor=SERVE_MAX_STEP_FACTOR)
    assert engine_config(_parse("--no-engine-process", "--max-step-factor", "none")) == EngineConfig()
    assert (args.host, args.port, args.api_key, args.shutdown_timeout) == ("127.0.0.1", 8000, None, 30.0)
    assert callable(args.func)


def test_flags_map_onto_engine_config():
    args = _parse("--model", "m.gguf", "--max-num-seqs", "1", "--max-waiting", "2", "--max-model-len", "256",
                  "--kv-cache-mib", "64", "--no-prefix-caching", "--api-key", "k", "--port", "9000")
    config = engine_config(args)
    assert (config.model, config.max_num_seqs, config.max_waiting, config.max_model_len) == ("m.gguf", 1, 2, 256)
    assert config.kv_cache_bytes == 64 << 20 and config.enable_prefix_caching is False
    assert (args.api_key, args.port) == ("k", 9000)


def test_step_time_flags_map_onto_the_scheduler():
    config = engine_config(_parse("--max-step-ms", "80", "--max-step-factor", "2.5", "--min-prefill-chunk", "4"))
    assert (config.max_step_ms, config.max_step_factor, config.min_prefill_chunk) == (80.0, 2.5, 4)
    with pytest.raises(ValueError, match="max_step_factor"):
        engine_config(_parse("--max-step-factor", "0.5"))


@pytest.mark.parametrize("dtype", ["auto", "float32", "float16", "bfloat16", "int8"])
def test_every_kv_cache_dtype_is_a_flag_value(dtype):
    assert engine_config(_parse("--kv-cache-dtype", dtype)).kv_cache_dtype == dtype


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "int4")


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("METRALE_API_KEY", "from-env")
    assert _parse().api_key is None  # the flag's default; the settings fall back to the variable
    assert RuntimeSettings.resolve(api_key=_parse().api_key).api_key == "from-env"
    assert RuntimeSettings.resolve(api_key=_parse("--api-key", "flag").api_key).api_key == "flag"


def test_bad_engine_values_are_refused():
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config(_parse("--max-num-seqs", "0"))


def test_the_metrale_command_has_serve():
    from metrale.cli import build_parser
    args = build_parser().parse_args(["serve", "--port", "1234"])
    assert args.command == "serve" and args.port == 1234


def test_a_bad_flag_value_is_an_error_line_not_a_traceback():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "metrale.cli", "serve", "--speculative-config", "{bad"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("metrale serve: error: speculative_config")


def test_host_repeats_and_comma_lists_join():
    from metrale.server.cli import listen_hosts

    assert listen_hosts(_parse().host) == ["127.0.0.1"]
    assert listen_hosts(_parse("--host", "0.0.0.0").host) == ["0.0.0.0"]  # replaces the default
    args = _parse("--host", "127.0.0.1", "--host", "::1,[fe80::1]", "--host", "127.0.0.1")
    assert listen_hosts(args.host) == ["127.0.0.1", "::1", "fe80::1"]
    with pytest.raises(ValueError, match="no address"):
        listen_hosts(" , ")


def test_bind_sockets_listens_on_every_address_or_on_none():
    import socket

    from metrale.server.cli import bind_sockets
    from tests.server.serve import free_port

    port = free_port()
    hosts = ["127.0.0.1"] + (["::1"] if socket.has_ipv6 and _ipv6_loopback() else [])
    sockets = bind_sockets(hosts, port)
    try:
        assert [s.getsockname()[1] for s in sockets] == [port] * len(hosts)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1 port {port}"):
            bind_sockets(["127.0.0.1"], port)  # taken: nothing else is left open either
    finally:
        for sock in sockets:
            sock.close()


def _ipv6_loopback() -> bool:
    import socket

    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


def test_allowed_origins_parse():
    from metrale.server.cors import parse_origins

    assert parse_origins(_parse().allowed_origins) == ()
    assert parse_origins(_parse("--allowed-origins", "https://a.example, http://b:3000/").allowed_origins) == (
        "https://a.example", "http://b:3000")
    assert parse_origins("*") == ("*",)
    with pytest.raises(ValueError, match="not an origin"):
        parse_origins("a.example")


def test_a_bad_allowed_hosts_value_is_an_error_line():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "metrale.cli", "serve", "--allowed-hosts", "http://x.example"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("metrale serve: error: --allowed-hosts")
