"""The proxy each backend URL goes through, read once from the process's environment."""

from __future__ import annotations

import base64
import logging
import urllib.parse
import urllib.request

logger = logging.getLogger(__name__)


class EnvProxies:
    """The proxy each URL goes through, from HTTP_PROXY / HTTPS_PROXY / NO_PROXY as they were when
    this was made, by the standard library's rules (as httpx read them; ALL_PROXY and ~/.netrc are
    not used); each scheme and host is decided once."""

    def __init__(self) -> None:
        found = urllib.request.getproxies_environment()
        self._bypass = found.get("no", "")
        self._proxies: dict[str, tuple[str, dict[str, str]]] = {}
        for scheme in ("http", "https"):
            if not found.get(scheme):
                continue
            try:
                proxy = urllib.parse.urlsplit(found[scheme])
                _ = proxy.port  # a port that is not one raises here, not at every request
            except ValueError as exc:
                proxy = None
                logger.warning("%s_PROXY=%s is not a URL (%s); requests go direct", scheme.upper(), found[scheme], exc)
            if proxy is None:
                continue
            if proxy.scheme != "http":  # aiohttp speaks to plain-HTTP proxies only
                logger.warning("%s_PROXY=%s is not an http:// proxy; requests go direct", scheme.upper(), found[scheme])
                continue
            headers = {}
            if proxy.username is not None:
                credentials = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
                headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
            self._proxies[scheme] = (proxy._replace(netloc=proxy.netloc.rpartition("@")[2]).geturl(), headers)
        self._decided: dict[tuple[str, str], tuple[str, dict[str, str]] | None] = {}
        # The proxies' own hosts: the operator's, connected to whatever they resolve to.
        self.hosts = frozenset(
            (urllib.parse.urlsplit(url).hostname or "").lower().rstrip(".") for url, _ in self._proxies.values()
        )

    def __call__(self, url: str) -> tuple[str, dict[str, str]] | None:
        """The proxy's URL and the headers it is sent (its credentials), or None: go direct."""
        if not self._proxies:
            return None
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        if key not in self._decided:
            proxy = self._proxies.get(parts.scheme)
            # NO_PROXY entries may name a host or a host:port, and an IPv6 one with or without brackets.
            host_port, host = parts.netloc.rpartition("@")[2], parts.hostname or ""
            # The standard library's own NO_PROXY rules (what getproxies and httpx follow); untyped in typeshed.
            bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
            no = {"no": self._bypass}
            if proxy is not None and (bypass(host_port, no) or bypass(host, no)):
                proxy = None
            self._decided[key] = proxy
        return self._decided[key]
