"""Media URL guard: vLLM fetches image/audio/video URLs itself, follows redirects and by default
reaches internal addresses (CVE-2025-6242), so the proxy refuses URLs that point inward.

Hosts are judged in every spelling an HTTP client would accept: decimal, octal, hex and short
IPv4 (`2130706433`, `0177.1`, `0x7f.1`, `127.1`), IPv6 with embedded IPv4 (mapped, compatible,
NAT64, 6to4), internal names (`localhost`, single-label names, `*.internal`, `*.local`, Kubernetes'
`*.svc` and `*.cluster.local`), after Unicode normalisation (full-width digits) and with a trailing
dot removed. Without `resolve_dns`, a two-label `service.namespace` name that a pod's DNS search
path completes cannot be told from a public name: in a cluster, turn `resolve_dns` on.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
import unicodedata
from urllib.parse import urlsplit

# Names that only resolve inside a site or cluster: RFC 6761/6762/8375, Kubernetes services
# (`svc`, `cluster.local`: `kubernetes.default.svc`), cloud metadata (`.internal`) and the private
# top-level names RFC 6762 appendix G lists.
INTERNAL_SUFFIXES = (".localhost", ".internal", ".local", ".localdomain", ".home.arpa", ".svc", ".cluster.local",
                     ".intranet", ".private", ".corp", ".home", ".lan")
INTERNAL_NAMES = frozenset(("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# Never global, whatever this Python's ipaddress tables say (3.11 calls them global): local-use
# NAT64 (RFC 8215) and SIIT's IPv4-translated ::ffff:0:a.b.c.d (RFC 2765) reach IPv4 behind a translator.
_TRANSLATED = (ipaddress.ip_network("64:ff9b:1::/48"), ipaddress.ip_network("::ffff:0:0:0/96"))
_UNSAFE_CHARS = frozenset("\\ \t\r\n")


class Forbidden(ValueError):
    """The URL may not be fetched; the message says why."""


def _loose_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """inet_aton's reading of `host` (1-4 parts, each decimal, 0-octal or 0x-hex), or None."""
    parts = host.split(".")
    if not 1 <= len(parts) <= 4:
        return None
    values = []
    for part in parts:
        if not part.isascii() or not part.isalnum():  # int() would also take "-1", "+1", "1_0", " 1"
            return None
        try:
            if part[:2] in ("0x", "0X"):
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part[0] == "0":
                values.append(int(part[1:], 8))
            else:
                values.append(int(part, 10))
        except ValueError:
            return None
    *head, last = values
    if any(v > 255 for v in head) or last >= 256 ** (5 - len(values)):
        return None
    number = 0
    for v in head:
        number = number << 8 | v
    number = number << 8 * (5 - len(values)) | last
    return ipaddress.IPv4Address(number)


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64 or (int(ip) >> 32 == 0 and int(ip) > 1):  # NAT64 or deprecated IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def check_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            check_ip(inner)
        if any(ip in net for net in _TRANSLATED):
            raise Forbidden(f"address {ip} is an IPv4 translation address")
    if ip.is_multicast or ip.is_unspecified or ip.is_loopback or ip.is_link_local or ip.is_private or not ip.is_global:
        raise Forbidden(f"address {ip} is not a public internet address")


def normalise_host(raw: str) -> str:
    host = unicodedata.normalize("NFKC", raw).lower()
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise Forbidden("host name is not a valid internationalised name") from None
    # after IDNA: "localhost\u3002" is "localhost." to an HTTP client (UTS 46 maps the dot)
    host = host.rstrip(".")
    if not host:
        raise Forbidden("URL has no host")
    return host


def host_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a host string denotes, in any spelling; None for a real name."""
    if host.startswith("[") or ":" in host:
        try:
            return ipaddress.IPv6Address(host.strip("[]"))
        except ValueError:
            raise Forbidden("malformed IPv6 host") from None
    return _loose_ipv4(host)


def check_url(
    url: str, schemes: frozenset[str], allowed_domains: tuple[str, ...] = (), block_internal: bool = True
) -> tuple[str, str | None]:
    """Raises Forbidden unless `url` is fetchable; returns (scheme, host name to resolve or None)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in schemes:
        allowed = ", ".join(sorted(schemes))
        raise Forbidden(f"URL scheme {scheme or '(none)'!r} is not allowed (allowed: {allowed})")
    if scheme == "data":
        return scheme, None
    if any(c in _UNSAFE_CHARS or ord(c) < 32 for c in url):
        raise Forbidden("URL contains backslashes, whitespace or control characters")
    rest = url.split(":", 1)[1]
    if not rest.startswith("//"):
        raise Forbidden("URL has no host")
    authority = rest[2:].split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    if "@" in authority:
        raise Forbidden("URL contains credentials")
    if "%" in authority:
        raise Forbidden("URL host contains percent-escapes")
    bracketed = "[" in authority
    try:
        netloc_host = urlsplit(url).hostname
    except ValueError:
        raise Forbidden("malformed URL") from None
    host = normalise_host(netloc_host or "")
    literal = host_literal(host)
    if bracketed and not isinstance(literal, ipaddress.IPv6Address):
        raise Forbidden("malformed IPv6 host")  # IPvFuture ([v1.x]) and the like
    name = None if literal is not None else host
    if block_internal:
        if literal is not None:
            check_ip(literal)
        elif host in INTERNAL_NAMES or host.endswith(INTERNAL_SUFFIXES) or "." not in host:
            raise Forbidden(f"host {host!r} is an internal name")
    if allowed_domains and not any(host == d or host.endswith("." + d) for d in allowed_domains):
        raise Forbidden(f"host {host!r} is not in the allowed domains")
    return scheme, name


class Resolver:
    """Optional DNS check: every address a name resolves to must be public. Small TTL cache.

    getaddrinfo runs on a small shared thread pool (libuv's 4 threads under uvloop) that the
    upstream connections use too, and a lookup we stop waiting for keeps its thread until the
    system resolver gives up (10 s and more): names under a DNS server that never answers would
    starve the data path. So at most `max_lookups` run at once, counted until they really end;
    beyond that a name is refused for now (not cached)."""

    def __init__(self, timeout_s: float = 0.5, ttl_s: float = 60.0, max_entries: int = 4096, max_lookups: int = 2) -> None:
        self.timeout = timeout_s
        self.ttl = ttl_s
        self.max_entries = max_entries
        self.max_lookups = max_lookups
        self.running = 0  # lookups whose thread is still busy
        self._cache: dict[str, tuple[float, str | None]] = {}

    async def check(self, host: str) -> None:
        now = time.monotonic()
        cached = self._cache.get(host)
        if cached is None or cached[0] < now:
            if self.running >= self.max_lookups:
                raise Forbidden(f"host {host!r} cannot be checked now (too many DNS lookups in progress)")
            verdict = await self._resolve(host)
            if len(self._cache) >= self.max_entries:
                self._cache.clear()
            self._cache[host] = cached = (now + self.ttl, verdict)
        if cached[1] is not None:
            raise Forbidden(cached[1])

    def _ended(self, lookup: asyncio.Future) -> None:
        self.running -= 1
        if not lookup.cancelled():
            lookup.exception()  # retrieved: a lookup we stopped waiting for logs nothing

    async def _resolve(self, host: str) -> str | None:
        loop = asyncio.get_running_loop()
        lookup = asyncio.ensure_future(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        self.running += 1
        lookup.add_done_callback(self._ended)
        try:
            infos = await asyncio.wait_for(asyncio.shield(lookup), self.timeout)
        except (OSError, asyncio.TimeoutError):
            return f"host {host!r} could not be resolved"
        for info in infos:
            try:
                check_ip(ipaddress.ip_address(info[4][0].split("%", 1)[0]))
            except Forbidden as exc:
                return f"host {host!r} resolves to a non-public address ({exc})"
        return None
