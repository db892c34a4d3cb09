"""The Host allow-list (metrale/server/hosts.py): loopback servers answer only loopback names, IP addresses and
their own names (DNS rebinding gets a 403 before anything runs); other listen addresses answer any Host unless
--allowed-hosts is given; "*" opens it."""

from __future__ import annotations

import pytest

from metrale.server.app import ServerApp
from metrale.server.hosts import HostPolicy, is_loopback, parse_allowed_hosts
from tests.server.fakes import FakeEngine, call

BODY = {"prompt": "a b", "max_tokens": 2}


@pytest.mark.parametrize("host", [None, "127.0.0.1:8000", "127.0.0.1", "localhost:8000", "LOCALHOST", "localhost.",
                                  "[::1]:8000", "[::1]", "app.localhost:8000", "192.168.1.20:8000", "[fe80::1]:80"])
def test_the_loopback_default_answers_loopback_names_and_addresses(host):
    assert HostPolicy.for_listen(["127.0.0.1"], None).allows(None if host is None else host.encode())


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example",
                                  "127.0.0.1.evil.example",
                                  "", ":8000", "localhost:80x", "[::1", "[::1]x", "loc\xe4lhost", "*"])
def test_the_loopback_default_refuses_other_names_and_malformed_hosts(host):
    assert not HostPolicy.for_listen(["127.0.0.1", "::1"], None).allows(host.encode("latin-1"))


def test_allowed_hosts_add_names_and_domains():
    policy = HostPolicy.for_listen(["127.0.0.1"], parse_allowed_hosts("gpu-box.lan, *.example.com"))
    assert policy.allows(b"gpu-box.lan:8000") and policy.allows(b"GPU-BOX.LAN") and policy.allows(b"a.b.example.com")
    assert not policy.allows(b"example.com") and not policy.allows(b"gpu-box.lan.evil") and not policy.allows(b"x.lan")
    assert policy.allows(b"localhost:8000")  # loopback names always pass


def test_names_given_to_host_are_the_servers_own():
    policy = HostPolicy.for_listen(["myhost.lan"], parse_allowed_hosts("api.example"))
    assert policy.allows(b"myhost.lan:8000") and policy.allows(b"api.example") and not policy.allows(b"evil.example")


@pytest.mark.parametrize("listen", [["0.0.0.0"], ["::"], ["10.0.0.5"], ["127.0.0.1", "0.0.0.0"], ["myhost.lan"]])
def test_listening_beyond_loopback_answers_any_host_unless_told(listen):
    assert HostPolicy.for_listen(listen, None).allows(b"metrale.ns.svc.cluster.local:8000")
    assert not HostPolicy.for_listen(listen, ("gpu-box.lan",)).allows(b"metrale.ns.svc.cluster.local")


def test_star_answers_any_host():
    assert HostPolicy.for_listen(["127.0.0.1"], parse_allowed_hosts("*")).allows(b"evil.example")


@pytest.mark.parametrize("value", ["http://x.example", "x.example:80", "*x.example", "a.*.example", "*."])
def test_bad_allowed_hosts_are_refused(value):
    with pytest.raises(ValueError, match="--allowed-hosts"):
        parse_allowed_hosts(value)


def test_loopback_addresses():
    assert all(is_loopback(a) for a in ("127.0.0.1", "127.1.2.3", "::1", "localhost"))
    assert not any(is_loopback(a) for a in ("0.0.0.0", "::", "10.0.0.1", "myhost"))


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/v1/completions"])
async def test_a_rebound_host_is_refused_before_anything_runs(path):
    engine = FakeEngine()
    app = ServerApp(engine, manage_engine=False)  # the embedded default: the loopback policy
    method = "POST" if path == "/v1/completions" else "GET"
    r = await call(app, method, path, BODY, headers={"host": "evil.example:8000"})
    assert r.status == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert engine.submitted == []
    r = await call(app, method, path, BODY, headers={"host": "127.0.0.1:8000"})
    assert r.status == 200
