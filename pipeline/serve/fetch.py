"""Fetching a remote media URL without reaching the server's own network.

A request that names ``http://127.0.0.1:8080/admin`` (or a public name that resolves to a private
address, or a public URL that redirects to one) must not make the server read its own loopback or
internal services. The check is on the address a connection actually goes to, not on the URL's
text: ``http.client`` opens every connection through ``_create_connection``, and ours refuses
loopback, private, link-local, multicast, reserved and unspecified addresses after DNS resolution.
Redirects go through the same opener, so every hop is checked; a name resolving to a checked
address cannot be swapped between the check and the connection (DNS rebinding), because the
connection is made to the very address that was checked.

Hosts named in ``serve.allowed_media_domains`` are exempt (an internal image store, say).
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import socket
import urllib.request
from typing import Any


class RefusedAddress(OSError):
    """The URL's host resolves to an address the server does not fetch from."""


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _guarded_connection(host_allowed: bool, address: tuple, timeout: Any = None, source_address: Any = None, **kw):
    """``socket.create_connection`` to a public address of ``address``'s host (or any, when allowed)."""
    host, port = address[0], address[1]
    errors: list[BaseException] = []
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if not host_allowed and not _public(sockaddr[0]):
            errors.append(RefusedAddress(f"{host} resolves to {sockaddr[0]}, a non-public address"))
            continue
        sock = socket.socket(family, kind, proto)
        try:
            if timeout is not None and timeout is not socket._GLOBAL_DEFAULT_TIMEOUT:
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as err:
            sock.close()
            errors.append(err)
    refused = [e for e in errors if isinstance(e, RefusedAddress)]
    raise (refused[0] if refused else errors[0] if errors else OSError(f"cannot resolve {host}"))


def _connection_class(base: type, allowed: frozenset[str]) -> type:
    class Guarded(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._create_connection = functools.partial(_guarded_connection, self.host.lower() in allowed)

    return Guarded


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, allowed: frozenset[str]) -> None:
        super().__init__()
        self.connection = _connection_class(http.client.HTTPConnection, allowed)

    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(self.connection, req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, allowed: frozenset[str]) -> None:
        super().__init__()
        self.connection = _connection_class(http.client.HTTPSConnection, allowed)

    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(self.connection, req, context=self._context)


def fetch(url: str, max_bytes: int, allowed_hosts: frozenset[str] = frozenset(), timeout: float = 20.0) -> bytes:
    """Up to ``max_bytes + 1`` bytes of ``url`` (the caller refuses more), following redirects, never
    from a non-public address unless the host is in ``allowed_hosts``. Raises ``RefusedAddress``
    for such an address, other ``OSError``/``ValueError`` for anything else that goes wrong."""
    allowed = frozenset(h.lower() for h in allowed_hosts)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _HTTP(allowed), _HTTPS(allowed))
    with opener.open(url, timeout=timeout) as response:
        return response.read(max_bytes + 1)
