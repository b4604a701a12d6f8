"""Fetch media named by a URL into bytes, in the API process, before the engine sees it.

Schemes: `data:` (base64, validated here), `http(s)://` (async, with a total
timeout, a byte cap and a bounded number of redirects) and `file://` (only under
the folder the server allows, after resolving symlinks and `..`). Every failure
is a MediaError / MediaLimitError that names the option to change and the kind
of media ("image" or "video"); decoding the bytes and checking pixels stays in
`foveal.multimodal.media.image` / `foveal.multimodal.media.video`.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import urllib.parse
from dataclasses import dataclass

from foveal.errors import MediaError, MediaLimitError
from foveal.multimodal.media.image import decode_data_url as decode_image_data_url
from foveal.multimodal.media.video import decode_video_data_url

_CHUNK_BYTES = 64 * 1024
_DATA_URL_DECODERS = {"image": decode_image_data_url, "video": decode_video_data_url}


@dataclass(frozen=True)
class MediaFetchConfig:
    timeout_s: float = 10.0  # whole fetch of one URL: connect, redirects, body
    max_bytes: int = 20 * 1024 * 1024
    max_redirects: int = 3
    allowed_local_media_path: str | None = None  # file:// allowed only under this folder


class MediaFetcher:
    """`await fetcher.fetch(url, kind) -> bytes`; one shared HTTP client per server.
    kind ("image" | "video") picks the data URL's expected MIME type and names
    the media in error messages."""

    def __init__(self, config: MediaFetchConfig) -> None:
        import httpx

        self.config = config
        self._client = httpx.AsyncClient(follow_redirects=True,
                                         max_redirects=config.max_redirects,
                                         timeout=config.timeout_s)
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
        except httpx.TooManyRedirects:
            raise MediaError(f"fetching {url[:120]!r} was redirected more than "
                             f"{self.config.max_redirects} times") from None
        except httpx.HTTPError as error:
            raise MediaError(f"fetching {url[:120]!r} failed ({type(error).__name__}: "
                             f"{error})") from None

    async def _download(self, url: str, kind: str) -> bytes:
        async with self._client.stream("GET", url) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching {url[:120]!r} returned HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit():
                self._check_size(int(declared), f"{kind} at {url[:120]!r}")
            body = bytearray()
            async for chunk in response.aiter_bytes(_CHUNK_BYTES):
                body += chunk
                self._check_size(len(body), f"{kind} at {url[:120]!r}")
            return bytes(body)

    def _from_file_url(self, url: str, kind: str) -> bytes:
        if self._local_root is None:
            raise MediaError(f"file:// {kind} URLs are disabled on this server; start it with "
                             "--allowed-local-media-path DIR to serve files under DIR")
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"file URL {url[:120]!r} names host {parsed.netloc!r}; "
                             "only local files are supported")
        path = pathlib.Path(urllib.parse.unquote(parsed.path))
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
