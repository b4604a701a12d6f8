"""MediaFetcher: data URLs, local files under the allowed folder only, and http(s)
with a byte cap, a total timeout and bounded redirects (against a local server)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import http.server
import io
import os
import threading
import time

import pytest
from PIL import Image


from foveal.errors import MediaError, MediaLimitError  # noqa: E402
from foveal.multimodal.media.fetch import MediaFetchConfig, MediaFetcher  # noqa: E402



def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()
SLOW_SECONDS = 5.0  # far past the tests' 1.5 s fetch timeout (a loaded 2-core machine took 0.5 s for ok.png)


class _MediaHandler(http.server.BaseHTTPRequestHandler):
    """/ok.png, /big.png (declared length), /big-unsized (no length header),
    /slow.png (answers after SLOW_SECONDS), /redirect/N (N hops to /ok.png)."""

    protocol_version = "HTTP/1.0"
    body_size_big = 300_000

    def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
        if self.path.startswith("/redirect/"):
            hops = int(self.path.rsplit("/", 1)[1])
            self.send_response(302)
            self.send_header("Location", f"/redirect/{hops - 1}" if hops > 1 else "/ok.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(SLOW_SECONDS)
        body = {"/ok.png": PNG, "/slow.png": PNG, "/big.png": b"x" * self.body_size_big,
                "/big-unsized": b"x" * self.body_size_big}.get(self.path)
        self.send_response(404 if body is None else 200)
        if body is not None and self.path != "/big-unsized":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client may hang up on an oversized body
            self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def media_http_server():
    """Yields the base URL of a local media server on 127.0.0.1."""
    with loopback_http_server(_MediaHandler) as base_url:
        yield base_url


@contextlib.contextmanager
def loopback_http_server(handler: type, host: str = "127.0.0.1"):
    """Serves `handler` on a free port of `host` (a loopback address) in a thread;
    yields the base URL."""
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads, server.block_on_close = True, False
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def fetch(url: str, **config) -> bytes:
    async def run() -> bytes:
        # The media server is on loopback, which only an allow-listed host may reach.
        fetcher = MediaFetcher(MediaFetchConfig(**{"timeout_s": 1.5, "max_bytes": 200_000,
                                                   "allowed_media_domains": ("127.0.0.1",),
                                                   **config}))
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    return asyncio.run(run())


def test_data_url_is_decoded():
    assert fetch("data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG


@pytest.mark.parametrize("url", ["data:image/png;base64,@@not-base64@@",
                                 "data:text/plain;base64,aGVsbG8=",
                                 "data:image/png,rawbytes"])
def test_bad_data_url_is_a_media_error(url):
    with pytest.raises(MediaError):
        fetch(url)


def test_data_url_over_the_byte_cap_is_refused():
    url = "data:image/png;base64," + base64.b64encode(b"x" * 3000).decode()
    with pytest.raises(MediaLimitError, match="--max-media-bytes"):
        fetch(url, max_bytes=1000)


def test_unknown_scheme_is_refused():
    with pytest.raises(MediaError, match="no supported scheme"):
        fetch("ftp://example.com/cat.png")


def test_file_url_is_disabled_without_an_allowed_folder(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        fetch(f"file://{tmp_path / 'a.png'}")


def test_file_url_inside_the_allowed_folder_is_read(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.png").write_bytes(PNG)
    assert fetch(f"file://{tmp_path / 'sub' / 'a.png'}",
                 allowed_local_media_path=str(tmp_path)) == PNG


def test_file_url_outside_the_allowed_folder_is_refused(tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "secret.png"
    allowed.mkdir()
    outside.write_bytes(PNG)
    with pytest.raises(MediaError, match="outside the allowed media folder"):
        fetch(f"file://{outside}", allowed_local_media_path=str(allowed))


def test_file_url_traversal_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="outside the allowed media folder"):
        fetch(f"file://{allowed}/../secret.png", allowed_local_media_path=str(allowed))


def test_symlink_out_of_the_allowed_folder_is_refused(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")
    with pytest.raises(MediaError, match="outside the allowed media folder"):
        fetch(f"file://{allowed / 'link.png'}", allowed_local_media_path=str(allowed))


def test_missing_local_file_is_a_media_error(tmp_path):
    with pytest.raises(MediaError, match="not found"):
        fetch(f"file://{tmp_path / 'nope.png'}", allowed_local_media_path=str(tmp_path))


def test_http_image_is_downloaded():
    with media_http_server() as base:
        assert fetch(f"{base}/ok.png") == PNG


def test_http_error_status_is_a_media_error():
    with media_http_server() as base, pytest.raises(MediaError, match="HTTP 404"):
        fetch(f"{base}/missing.png")


@pytest.mark.parametrize("path", ["/big.png", "/big-unsized"])
def test_http_body_over_the_byte_cap_is_refused(path):
    with media_http_server() as base, pytest.raises(MediaLimitError, match="--max-media-bytes"):
        fetch(base + path)


def test_http_fetch_slower_than_the_timeout_is_refused():
    with media_http_server() as base, pytest.raises(MediaError, match="--media-fetch-timeout"):
        fetch(f"{base}/slow.png", timeout_s=0.3)


def test_redirects_are_followed_up_to_the_limit():
    with media_http_server() as base:
        assert fetch(f"{base}/redirect/2", max_redirects=3) == PNG
        with pytest.raises(MediaError, match="redirected more than 3 times"):
            fetch(f"{base}/redirect/5", max_redirects=3)
