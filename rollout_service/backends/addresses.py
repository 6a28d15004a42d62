"""Which addresses the service connects to: names resolved at every connection and each address
checked against the service's address policy (--allow-backends), so that a backend's name cannot
be pointed elsewhere after it was checked (DNS rebinding)."""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult


class RefusedAddress(OSError):
    """What an address policy raises from inside the resolver: aiohttp reports it as a failed
    connection, whose cause `_send` reads back as AddressRefused."""


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")

Lookup = Callable[[str, int, int], Awaitable[list[ResolveResult]]]  # (host, port, family) -> its addresses


class AddressPolicy(Protocol):
    """Which addresses the service may connect to. `lookup` resolves a name (the system's resolver,
    or a stand-in); `refusal` says why the addresses a name resolved to may not be reached, or None."""

    lookup: Lookup

    async def refusal(self, host: str, addresses: list[str]) -> str | None: ...


async def system_lookup(host: str, port: int = 0, family: int = socket.AF_UNSPEC) -> list[ResolveResult]:
    """`host`'s addresses from the system's resolver, as aiohttp's own resolver reads them."""
    return await aiohttp.ThreadedResolver().resolve(host, port, socket.AddressFamily(family))


class CheckedResolver(AbstractResolver):
    """Resolves each name once per connection, checks every address it got against the policy and
    hands aiohttp only checked addresses to connect to: a name that resolved to an allowed address
    when its backend was added and resolves elsewhere later (DNS rebinding) is refused at that
    connection. aiohttp resolves no IP address (one cannot change); `trusted` names (the proxies the
    environment configures) are the operator's and resolved unchecked."""

    def __init__(self, policy: AddressPolicy, trusted: frozenset[str] = frozenset()) -> None:
        self._policy = policy
        self._trusted = trusted

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._policy.lookup(host, port, family)
        if host.lower().rstrip(".") not in self._trusted:
            why = await self._policy.refusal(host, [str(r["host"]) for r in found])
            if why is not None:
                raise RefusedAddress(why)
        return found

    async def close(self) -> None:
        pass


def canonical_ipv4(url: str) -> str | None:
    """`url` with its host written as the canonical dotted IPv4 address it stands for (inet_aton's
    reading, as the resolver's: "127.1", "2130706433"); None where it is no such host or is already."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        canonical = socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None
    if canonical == host:
        return None
    netloc = canonical if parts.port is None else f"{canonical}:{parts.port}"
    return parts._replace(netloc=netloc).geturl()


def parse_allowed(entry: str) -> Network | str:
    """One `--allow-backends` entry: a network (an address is a network of one), or a host name in
    lower case; ValueError for anything else."""
    text = entry.strip()
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        pass
    if text.lower() == "loopback":
        return "loopback"
    if not _HOST_NAME.fullmatch(text) or text.replace(".", "").isdigit():
        raise ValueError(f"{entry!r} is not a host name, an IP address or a CIDR (e.g. 10.0.0.0/8)")
    return text.lower().rstrip(".")
