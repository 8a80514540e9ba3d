"""The worker set from the client's endpoints: static ones as written, DNS ones resolved.

``dns+tcp://NAME:PORT`` names every worker behind one DNS name (a Kubernetes headless Service):
it stands for ``tcp://ADDR:PORT`` for each A and AAAA record of NAME, as the system resolver
(``socket.getaddrinfo``, so ``/etc/hosts`` and the search domains of ``resolv.conf`` apply)
returns them. The set is resolved again every ``resolve_interval_ms`` and, no more often than
``RESOLVE_RETRY_S``, after a failed connect; the client's connect thread does it, never the
engine's step path.

SRV records are not read: the standard library has no SRV lookup, and every pod of a
StatefulSet serves on the same port, which the endpoint names. A name that fails to resolve
keeps the addresses it had (a DNS outage must not empty the worker set).

``resolver``: a callable ``(name, port) -> addresses`` that replaces ``getaddrinfo`` (tests, or
an engine with its own service discovery). It may raise ``OSError`` for a failed lookup.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Final

from .transport import EndpointError, parse_endpoint

__all__ = ["DNS_SCHEME", "Discovery", "Resolver", "check_endpoint", "is_dns_endpoint",
           "parse_dns_endpoint", "system_resolver", "tcp_endpoint"]

log = logging.getLogger("dspark_client")

DNS_SCHEME: Final = "dns+tcp://"
# After a failed connect the set is resolved again, but no more often than this: a dead
# worker must not turn every backoff step into a DNS query.
RESOLVE_RETRY_S: Final = 1.0

Resolver = Callable[[str, int], Sequence[str]]


def parse_dns_endpoint(endpoint: str) -> tuple[str, int]:
    """``dns+tcp://NAME:PORT`` -> (NAME, PORT); EndpointError naming what is wrong."""
    if endpoint.startswith("dns+srv://"):
        raise EndpointError(f"endpoint {endpoint!r}: SRV records are not supported; name the"
                            " port: dns+tcp://NAME:PORT")
    if not endpoint.startswith(DNS_SCHEME):
        raise EndpointError(f"endpoint {endpoint!r}: not a {DNS_SCHEME}NAME:PORT endpoint")
    ep = parse_endpoint("tcp://" + endpoint[len(DNS_SCHEME):])
    return ep.host, ep.port


def is_dns_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(("dns+tcp://", "dns+srv://"))


def check_endpoint(endpoint: str) -> None:
    """Raise EndpointError unless ``endpoint`` is one the client can use."""
    if is_dns_endpoint(endpoint):
        parse_dns_endpoint(endpoint)
    else:
        parse_endpoint(endpoint)


def system_resolver(name: str, port: int) -> list[str]:
    """Every A and AAAA address of ``name`` through ``socket.getaddrinfo``, in its order."""
    out: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in socket.getaddrinfo(
            name, port, type=socket.SOCK_STREAM):
        addr = str(sockaddr[0])
        if addr not in out:
            out.append(addr)
    return out


def tcp_endpoint(address: str, port: int) -> str:
    """``tcp://ADDR:PORT``, brackets around an IPv6 address; ValueError for a non-address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    return f"tcp://[{address}]:{port}" if ip.version == 6 else f"tcp://{address}:{port}"


class Discovery:
    """The client's endpoints, with the DNS ones resolved to addresses."""

    def __init__(self, endpoints: Sequence[str], resolver: Resolver | None = None) -> None:
        self.static: list[str] = []
        self.names: list[tuple[str, str, int]] = []  # (endpoint, name, port)
        for ep in endpoints:
            if is_dns_endpoint(ep):
                name, port = parse_dns_endpoint(ep)
                self.names.append((ep, name, port))
            else:
                check_endpoint(ep)
                if ep not in self.static:
                    self.static.append(ep)
        self.resolver: Resolver = resolver or system_resolver
        self._last: dict[str, list[str]] = {}  # per DNS endpoint: its last good answer
        self.last_error: str | None = None

    @property
    def dynamic(self) -> bool:
        """True when some endpoint is resolved (the set can change while the client runs)."""
        return bool(self.names)

    def resolve(self) -> list[str]:
        """The current set: static endpoints, then every resolved address (deduplicated). A
        failed lookup keeps that name's previous answer and sets ``last_error``."""
        out = list(self.static)
        self.last_error = None
        for ep, name, port in self.names:
            try:
                found = [tcp_endpoint(a, port) for a in self.resolver(name, port)]
            except (OSError, ValueError, UnicodeError) as exc:
                self.last_error = f"resolving {ep}: {exc}"
                found = self._last.get(ep, [])
            else:
                if found:
                    self._last[ep] = found
                else:
                    self.last_error = f"resolving {ep}: no address"
                    found = self._last.get(ep, [])
            for e in found:
                if e not in out:
                    out.append(e)
        return out
