"""Which `Host` headers the server answers: the defence against DNS rebinding.

A web page cannot read a loopback server's answers (the browser's same-origin rule), unless its own
name resolves to 127.0.0.1: then its requests carry `Host: evil.example`. So, as Ollama does:

    listening on loopback only (the default)   Host must be an IP address, `localhost` or `*.localhost`,
                                               a name given to --host, or one of --allowed-hosts
    listening on any other address             any Host, unless --allowed-hosts is given (then as above)
    --allowed-hosts "*"                        any Host

    --allowed-hosts "gpu-box.lan,*.example.com"     exact names, or every name under a domain

An IP-literal Host is always accepted: a browser sends one only when it connects to that address itself,
which no rebinding can arrange. A request without a Host header (HTTP/1.0) is accepted. The port is not
checked. Anything else gets a 403 before its body is read.
"""

from __future__ import annotations

import ipaddress

_LOOPBACK_NAMES = ("localhost",)


def parse_allowed_hosts(value: str | None) -> tuple[str, ...] | None:
    """A comma list of host names, `*.domain` patterns or "*"; None when not given. ValueError on a bad one."""
    if value is None:
        return None
    names = []
    for name in (n.strip().lower() for n in value.split(",") if n.strip()):
        if name == "*":
            names.append(name)
            continue
        wildcard = "*." if name.startswith("*.") else ""
        bare = name.removeprefix(wildcard).rstrip(".")  # "localhost." is "localhost"
        if not bare or "*" in bare or ":" in bare or "/" in bare:
            raise ValueError(f"--allowed-hosts: {name!r} is not a host name, *.domain or *")
        names.append(wildcard + bare)
    return tuple(names)


def is_loopback(address: str) -> bool:
    """Whether a listen address (an IP or a name) is this machine's loopback."""
    if address.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


class HostPolicy:
    """The Host headers one server answers; see the module docstring."""

    def __init__(self, names: tuple[str, ...] = (), *, any_host: bool = False) -> None:
        self.any_host = any_host or "*" in names
        self.names = frozenset(n for n in names if not n.startswith("*."))
        self.suffixes = tuple(n[1:] for n in names if n.startswith("*."))  # ".example.com"

    @classmethod
    def for_listen(cls, listen: list[str], allowed: tuple[str, ...] | None) -> "HostPolicy":
        """The policy of a server listening on `listen` with --allowed-hosts `allowed` (None: not given)."""
        if allowed is None and not all(is_loopback(address) for address in listen):
            return cls(any_host=True)
        own_names = tuple(a.lower() for a in listen if not _is_ip(a))
        return cls(own_names + (allowed or ()))

    def allows(self, host: bytes | None) -> bool:
        """Whether a request with this Host header value (None: no header) is answered."""
        if host is None or self.any_host:
            return True
        name = _host_name(host)
        if name is None:
            return False
        if _is_ip(name) or name in _LOOPBACK_NAMES or name.endswith(".localhost") or name in self.names:
            return True
        return name.endswith(self.suffixes)


def _host_name(host: bytes) -> str | None:
    """The lower-case name or address of a Host header ("[::1]:8000" -> "::1"), or None if malformed."""
    try:
        text = host.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        address, bracket, port = text[1:].partition("]")
        if not bracket or (port and not (port.startswith(":") and port[1:].isdigit())):
            return None
        return address
    name, colon, port = text.partition(":")
    if colon and not port.isdigit():
        return None
    name = name.rstrip(".")
    return name or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
