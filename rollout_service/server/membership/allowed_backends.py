"""What a backend added at runtime (POST /envs, POST /replicas) may be: an address the operator allowed.

`--allow-backends` lists host names, addresses and CIDRs; by default loopback. The hosts of the
backends given at start are always allowed (the operator named them). A URL's host is resolved and
every address it resolves to must be allowed, so no spelling gets around the list: a decimal or hex
IP (`2130706433`, `0x7f.1`), an IPv6 form, or a DNS name that points inside the network. A host
named in the list is allowed by its name whatever it resolves to (a compose service, a node name).

The rule holds at every connection, not only when a backend is added: the service's transports
resolve each name through `lookup` and ask `refusal` before connecting (rollout_service/backends/transport.py,
CheckedResolver), so a name that resolves elsewhere later (DNS rebinding) is not connected to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

import yarl

from ...backends.addresses import Lookup, Network, parse_allowed, system_lookup
from ..errors import Invalid

LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_RESOLVE_TIMEOUT_S = 10.0


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return _canonical(ipaddress.ip_address(text.split("%", 1)[0]))


def _canonical(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1
    return address


class AllowedBackends:
    """The networks and names a runtime-added backend may be at."""

    def __init__(self, entries: Iterable[str], start_urls: Iterable[str], lookup: Lookup = system_lookup) -> None:
        self.lookup = lookup  # the resolver, both here and at each connection (a stand-in in tests)
        parsed = [parse_allowed(e) for e in entries] or ["loopback"]
        self.networks: list[Network] = [p for p in parsed if not isinstance(p, str)]
        if "loopback" in parsed:
            self.networks += LOOPBACK
        self.names = {p for p in parsed if isinstance(p, str) and p != "loopback"}
        # The backends given at start: their hosts by name, and (below) by the addresses they resolve to.
        self.start_hosts = {_host(url) for url in start_urls}
        self.names |= self.start_hosts

    def describe(self) -> str:
        return ", ".join(sorted(str(n) for n in self.networks) + sorted(self.names)) or "nothing"

    async def check(self, url: str, what: str) -> None:
        """Invalid (422 backend_not_allowed) unless `url`'s host is allowed, by name or by
        every address it resolves to. Nothing is sent to it here."""
        host = _host(url)
        why = await self.refusal(host, None if host in self.names else await self._resolve(host))
        if why is not None:
            raise Invalid(
                "backend_not_allowed",
                f"{what} {url}: {why}"
                + ("" if "does not resolve" in why else ": start the service with --allow-backends naming it"),
            )

    async def refusal(self, host: str, addresses: list[str] | None) -> str | None:
        """Why a backend at `host`, which resolved to `addresses`, may not be reached; None if it may."""
        host = host.lower().rstrip(".")
        if host in self.names:
            return None
        found = {_address(a) for a in addresses or ()}
        if not found:
            return "its host does not resolve here; it is not an allowed backend"
        networks = list(self.networks)
        if any(not any(a in n for n in networks) for a in found):
            for name in self.names:  # a name allowed, or given at start, allows the addresses it has now
                networks += [ipaddress.ip_network(_address(a)) for a in await self._resolve(name)]
        refused = sorted({str(a) for a in found if not any(a in n for n in networks)})
        if refused:
            return (
                f"{host} resolves to {', '.join(refused)}, outside what this service may reach "
                f"(--allow-backends: {self.describe()})"
            )
        return None

    async def _resolve(self, host: str) -> list[str]:
        """Every address `host` resolves to, as the transport would connect (the resolver takes an IP
        in any spelling); empty if it does not resolve in time."""
        try:
            return [str(_canonical(ipaddress.ip_address(host.strip("[]"))))]
        except ValueError:
            pass
        try:
            found = await asyncio.wait_for(self.lookup(host, 0, socket.AF_UNSPEC), _RESOLVE_TIMEOUT_S)
        except (OSError, UnicodeError, TimeoutError):
            return []
        return [str(r["host"]) for r in found]


def _host(url: str) -> str:
    # Read as the transport reads it (yarl, aiohttp's URL type): the host checked is the host connected to.
    return (yarl.URL(url).host or "").lower().rstrip(".")
