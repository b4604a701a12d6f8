"""Fetch media named by a URL into bytes, in the API process, before the engine sees it.

Schemes: `data:` (base64, validated here), `http(s)://` (async, with a total
timeout, a byte cap and a bounded number of redirects) and `file://` (only under
the folder the server allows, after resolving symlinks and `..`). Every failure
is a MediaError / MediaLimitError that names the option to change and the kind
of media ("image" or "video"); decoding the bytes and checking pixels stays in
`foveal.multimodal.media.image` / `foveal.multimodal.media.video`.

Server-side request forgery: a client must not make the server fetch from its own
network (loopback, RFC 1918 / ULA, link-local incl. the cloud metadata address,
carrier-grade NAT, multicast, reserved; IPv4 inside IPv6 is judged as the IPv4
address). Each hop of an http(s) fetch (redirects are followed here, one by one):
1. the host name is resolved once (`loop.getaddrinfo`) and every address checked
   (`blocked_address_kind`); one bad address refuses the URL;
2. the request goes to a checked address itself: the URL sent to httpx names the
   IP, the `Host` header the original host and port, and for https the
   `sni_hostname` extension the original host, so TLS sends that name and the
   certificate is verified against it. No second lookup happens, so a name that
   changes its answer (DNS rebinding) cannot move the connection elsewhere.
Keep-alive is off (a pooled connection is keyed by IP and would carry one host's
TLS session to another name) and proxy variables are ignored (a proxy would make
its own lookup). `--allowed-media-domains` lets only the listed host names
through (exact, case-insensitive match: a subdomain is a different host), to any
address they resolve to; `--allow-private-media-urls` turns the address check off.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import pathlib
import socket
import urllib.parse
from dataclasses import dataclass

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.image import decode_data_url as decode_image_data_url
from foveal.multimodal.media.video import decode_video_data_url

_CHUNK_BYTES = 64 * 1024
_DATA_URL_DECODERS = {"image": decode_image_data_url, "video": decode_video_data_url}
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CARRIER_GRADE_NAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_OPT_OUT = ("list the host in --allowed-media-domains, or start the server with "
            "--allow-private-media-urls on a trusted network")


@dataclass(frozen=True)
class MediaFetchConfig:
    timeout_s: float = 10.0  # whole fetch of one URL: connect, redirects, body
    max_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3
    allowed_local_media_path: str | None = None  # file:// allowed only under this folder
    # None: any http(s) host whose addresses are all public; a tuple: only these host
    # names (exact match), to whatever address they resolve to.
    allowed_media_domains: tuple[str, ...] | None = None
    allow_private_media_urls: bool = False  # trusted networks: no address check


def blocked_address_kind(address: str) -> str | None:
    """Why the server must not connect to `address` ("loopback", "private",
    "link-local", ...), or None for a public unicast address. IPv4-mapped and
    NAT64 IPv6 are judged as their IPv4 address; 6to4 and Teredo also by it."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 scope id
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return blocked_address_kind(str(ip.ipv4_mapped))
        if ip in _NAT64:
            return blocked_address_kind(str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
        for tunnelled in (ip.sixtofour, ip.teredo[1] if ip.teredo else None):
            inner = None if tunnelled is None else blocked_address_kind(str(tunnelled))
            if inner is not None:
                return f"{inner} (tunnelled in {ip})"
    checks = (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
              ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
              ("carrier-grade NAT", ip in _CARRIER_GRADE_NAT), ("reserved", ip.is_reserved),
              ("private", ip.is_private), ("not globally routable", not ip.is_global))
    return next((kind for kind, hit in checks if hit), None)


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in the resolver's order, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def _host_key(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


class MediaFetcher:
    """`await fetcher.fetch(url, kind) -> bytes`; one shared HTTP client per server.
    kind ("image" | "video") picks the data URL's expected MIME type and names
    the media in error messages."""

    def __init__(self, config: MediaFetchConfig, *, transport=None) -> None:
        """transport: an httpx.AsyncBaseTransport to send through (own TLS roots, tests)."""
        import httpx

        self.config = config
        self._client = httpx.AsyncClient(follow_redirects=False, timeout=config.timeout_s,
                                         trust_env=False, transport=transport,
                                         limits=httpx.Limits(max_keepalive_connections=0))
        domains = config.allowed_media_domains
        self._allowed_hosts = None if domains is None else frozenset(map(_host_key, domains))
        root = config.allowed_local_media_path
        self._local_root = pathlib.Path(root).resolve() if root else None

    async def fetch(self, url: str, kind: str = "image") -> bytes:
        if kind not in _DATA_URL_DECODERS:
            raise ValueError(f"kind={kind!r}; use one of {sorted(_DATA_URL_DECODERS)}")
        if not isinstance(url, str):
            raise MediaError(f"a {kind} URL is a string, got {type(url).__name__}")
        scheme = urllib.parse.urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            return self._from_data_url(url, kind)
        if scheme in ("http", "https"):
            return await self._from_http(url, kind)
        if scheme == "file":
            return await asyncio.to_thread(self._from_file_url, url, kind)
        raise MediaError(f"{kind} URL {url[:80]!r} has no supported scheme; use a "
                         f"data:{kind}/...;base64 URL, an http(s):// URL or a file:// URL")

    async def aclose(self) -> None:
        await self._client.aclose()

    def _check_size(self, num_bytes: int, source: str) -> None:
        if num_bytes > self.config.max_bytes:
            raise MediaLimitError(f"{source} is {num_bytes} bytes or more; the limit is "
                                  f"{self.config.max_bytes} bytes (--max-media-bytes)")

    def _from_data_url(self, url: str, kind: str) -> bytes:
        # base64 is 4 chars per 3 bytes: refuse before decoding an oversized payload.
        self._check_size(len(url) * 3 // 4 - 96, f"{kind} data URL payload")
        data = _DATA_URL_DECODERS[kind](url)
        self._check_size(len(data), f"{kind} data URL payload")
        return data

    async def _from_http(self, url: str, kind: str) -> bytes:
        import httpx

        try:
            return await asyncio.wait_for(self._download(url, kind), self.config.timeout_s)
        except asyncio.TimeoutError:
            raise MediaError(f"fetching {url[:120]!r} took over {self.config.timeout_s:g} s "
                             "(--media-fetch-timeout)") from None
        except httpx.InvalidURL as error:
            raise MediaError(f"{kind} URL {url[:120]!r} is not a valid URL ({error})") from None
        except httpx.HTTPError as error:
            raise MediaError(f"fetching {url[:120]!r} failed ({type(error).__name__}: "
                             f"{error})") from None

    async def _download(self, url: str, kind: str) -> bytes:
        import httpx

        target = httpx.URL(url)
        for _ in range(self.config.max_redirects + 1):
            response = await self._send_pinned(target, await self._checked_addresses(target, kind))
            try:
                location = response.headers.get("location")
                if response.status_code in _REDIRECT_STATUSES and location:
                    target = self._redirect_target(target, location, kind)
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching {url[:120]!r} returned HTTP "
                                     f"{response.status_code}")
                return await self._read_body(response, f"{kind} at {url[:120]!r}")
            finally:
                await response.aclose()
        raise MediaError(f"fetching {url[:120]!r} was redirected more than "
                         f"{self.config.max_redirects} times")

    async def _checked_addresses(self, target, kind: str) -> list[str]:
        """The addresses to connect to for `target`, after the allow-list and the
        address check; a MediaError naming the option to change otherwise."""
        host = target.raw_host.decode("ascii")
        if not host:
            raise MediaError(f"{kind} URL {str(target)[:120]!r} names no host")
        if self._allowed_hosts is not None and _host_key(host) not in self._allowed_hosts:
            raise MediaError(f"{kind} URL host {host!r} is not in the server's allowed media "
                             f"hosts {sorted(self._allowed_hosts)} (--allowed-media-domains)")
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            addresses = await resolve_addresses(host, port)
        except (socket.gaierror, UnicodeError) as error:
            raise MediaError(f"cannot resolve {kind} URL host {host!r} ({error})") from None
        if self._allowed_hosts is None and not self.config.allow_private_media_urls:
            for address in addresses:
                if (blocked := blocked_address_kind(address)) is not None:
                    raise MediaError(f"{kind} URL host {host!r} resolves to {address}, a "
                                     f"{blocked} address, which the server does not fetch "
                                     f"from; {_OPT_OUT}")
        return addresses

    async def _send_pinned(self, target, addresses: list[str]):
        """GET `target` from the first of `addresses` that accepts a connection (see
        the module docstring: IP in the URL, the name in Host and SNI)."""
        import httpx

        headers = {"Host": target.netloc.decode("ascii")}
        extensions = {"sni_hostname": target.raw_host.decode("ascii")} \
            if target.scheme == "https" else {}
        for index, address in enumerate(addresses):
            request = self._client.build_request("GET", target.copy_with(host=address),
                                                 headers=headers, extensions=extensions)
            try:
                return await self._client.send(request, stream=True)
            except httpx.ConnectError:
                if index == len(addresses) - 1:
                    raise
        raise MediaError(f"the host of {str(target)[:120]!r} has no address")

    def _redirect_target(self, target, location: str, kind: str):
        redirected = target.join(location)
        if redirected.scheme not in ("http", "https"):
            raise MediaError(f"{kind} URL {str(target)[:120]!r} redirects to a "
                             f"{redirected.scheme}: URL; only http(s) redirects are followed")
        return redirected

    async def _read_body(self, response, source: str) -> bytes:
        declared = response.headers.get("content-length", "")
        if declared.isdigit():
            self._check_size(int(declared), source)
        body = bytearray()
        async for chunk in response.aiter_bytes(_CHUNK_BYTES):
            body += chunk
            self._check_size(len(body), source)
        return bytes(body)

    def _from_file_url(self, url: str, kind: str) -> bytes:
        if self._local_root is None:
            raise MediaError(f"file:// {kind} URLs are disabled on this server; start it with "
                             "--allowed-local-media-path DIR to serve files under DIR")
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {url[:120]!r} names host {parsed.netloc!r}; "
                             "only local files are supported")
        unquoted = urllib.parse.unquote(parsed.path)
        if "\x00" in unquoted:
            raise MediaError(f"file URL {url[:120]!r} holds a NUL character; no file has one")
        path = pathlib.Path(unquoted)
        resolved = pathlib.Path(os.path.realpath(path))
        if ".." in path.parts or not resolved.is_relative_to(self._local_root):
            raise MediaError(f"file {str(path)!r} is outside the allowed media folder "
                             f"{str(self._local_root)!r} (--allowed-local-media-path)")
        try:
            self._check_size(resolved.stat().st_size, f"file {str(path)!r}")
            return resolved.read_bytes()
        except FileNotFoundError:
            raise MediaError(f"{kind} file not found: {str(path)!r}") from None
        except OSError as error:
            raise MediaError(f"cannot read {kind} file {str(path)!r} "
                             f"({error.strerror or error})") from None
