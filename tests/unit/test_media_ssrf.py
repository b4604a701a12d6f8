"""The media fetcher refuses URLs that reach the server's own network (after DNS, on
every redirect), connects to the address it checked, and keeps file:// inside the
allowed folder. "Public" hosts are loopback servers on 127.0.0.2 that a test declares
public by patching the resolver and the address check (there is no internet here)."""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import http.server
import ipaddress
import os
import ssl
import threading

import httpx
import pytest

from foveal.errors import MediaError
from foveal.multimodal.media import fetch as fetch_module
from foveal.multimodal.media.fetch import MediaFetchConfig, MediaFetcher, blocked_address_kind
from tests.unit.test_media_fetch import PNG, loopback_http_server

PUBLIC_HOST = "127.0.0.2"  # stands in for a public address in the tests that say so


class _RecordingHandler(http.server.BaseHTTPRequestHandler):
    """/ok.png; /to?URL redirects to URL. Every request's path and Host header go to
    the class's `seen` list."""

    protocol_version = "HTTP/1.0"
    seen: list[tuple[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
        type(self).seen.append((self.path, self.headers.get("Host", "")))
        if self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path[len("/to?"):])
            self.end_headers()
            return
        body = PNG if self.path == "/ok.png" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _recording_handler() -> type:
    return type("Handler", (_RecordingHandler,), {"seen": []})


def fetch(url: str, transport=None, **config) -> bytes:
    async def run() -> bytes:
        fetcher = MediaFetcher(MediaFetchConfig(**{"timeout_s": 2.0, **config}),
                               transport=transport)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    return asyncio.run(run())


class FakeDNS:
    """Answers the names in `answers` ({name: [address, ...]}) without DNS, other names
    for real; `calls` lists every name asked."""

    def __init__(self, real) -> None:
        self.real, self.answers, self.calls = real, {}, []

    async def resolve(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        return list(self.answers[host]) if host in self.answers else await self.real(host, port)


@pytest.fixture()
def fake_dns(monkeypatch) -> FakeDNS:
    dns = FakeDNS(fetch_module.resolve_addresses)
    monkeypatch.setattr(fetch_module, "resolve_addresses", dns.resolve)
    return dns


@pytest.fixture()
def public_test_host(monkeypatch):
    """PUBLIC_HOST passes the address check; every other address is judged as usual."""
    real = fetch_module.blocked_address_kind
    monkeypatch.setattr(fetch_module, "blocked_address_kind",
                        lambda address: None if address == PUBLIC_HOST else real(address))


@pytest.mark.parametrize("address, kind", [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("172.31.255.254", "private"),
    ("192.168.1.1", "private"), ("fd12:3456::1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("fe80::1%2", "link-local"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"),
    ("100.64.0.1", "carrier-grade NAT"), ("240.0.0.1", "reserved"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"),
    ("::ffff:10.0.0.1", "private"), ("64:ff9b::a9fe:a9fe", "link-local"),
    ("2002:7f00:1::", "loopback (tunnelled in 2002:7f00:1::)"),
])
def test_internal_addresses_are_blocked_by_kind(address, kind):
    assert blocked_address_kind(address) == kind


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "2606:4700::1111",
                                     "::ffff:8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass(address):
    assert blocked_address_kind(address) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "2130706433", "0x7f.1", "127.1"])
def test_a_url_reaching_loopback_is_refused_after_resolution(host):
    handler = _recording_handler()
    with loopback_http_server(handler) as base, pytest.raises(MediaError) as refused:
        port = base.rsplit(":", 1)[1]
        fetch(f"http://{host}:{port}/ok.png")
    message = str(refused.value)
    assert "loopback address" in message
    assert "--allowed-media-domains" in message and "--allow-private-media-urls" in message
    assert handler.seen == []


@pytest.mark.parametrize("host, kind", [
    ("10.0.0.1", "private"), ("172.16.0.1", "private"), ("192.168.0.1", "private"),
    ("169.254.169.254", "link-local"), ("[::ffff:127.0.0.1]", "loopback"),
    ("[::ffff:a9fe:a9fe]", "link-local"), ("100.64.1.1", "carrier-grade NAT"),
])
def test_a_url_naming_an_internal_address_is_refused_before_connecting(host, kind):
    sent = []
    transport = httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(200))
    with pytest.raises(MediaError, match=f"a {kind} address"):
        fetch(f"http://{host}/latest/meta-data/", transport=transport)
    assert sent == []


def test_a_name_is_refused_when_any_of_its_addresses_is_internal(fake_dns):
    fake_dns.answers["internal.test"] = ["10.0.0.7"]
    fake_dns.answers["mixed.test"] = ["93.184.216.34", "192.168.3.4"]
    with pytest.raises(MediaError, match="'internal.test' resolves to 10.0.0.7, a private"):
        fetch("http://internal.test/cat.png")
    with pytest.raises(MediaError, match="resolves to 192.168.3.4, a private"):
        fetch("https://mixed.test/cat.png")


def test_a_redirect_from_a_public_host_to_loopback_is_refused(fake_dns, public_test_host):
    public, internal = _recording_handler(), _recording_handler()
    with loopback_http_server(public, PUBLIC_HOST) as public_base, \
            loopback_http_server(internal) as internal_base:
        fake_dns.answers["public.test"] = [PUBLIC_HOST]
        public_url = public_base.replace(PUBLIC_HOST, "public.test")
        assert fetch(f"{public_url}/ok.png") == PNG
        with pytest.raises(MediaError, match="a loopback address"):
            fetch(f"{public_url}/to?{internal_base}/ok.png")
        fake_dns.answers["metadata.test"] = ["169.254.169.254"]
        with pytest.raises(MediaError, match="'metadata.test' resolves to 169.254.169.254"):
            fetch(f"{public_url}/to?http://metadata.test/latest/meta-data/")
        with pytest.raises(MediaError, match="only http"):
            fetch(f"{public_url}/to?file:///etc/passwd")
    assert internal.seen == []
    assert [path for path, _ in public.seen] == [
        "/ok.png", f"/to?{internal_base}/ok.png", "/to?http://metadata.test/latest/meta-data/",
        "/to?file:///etc/passwd"]


def test_the_request_goes_to_the_checked_address_with_the_original_host(fake_dns,
                                                                       public_test_host):
    server = _recording_handler()
    with loopback_http_server(server, PUBLIC_HOST) as base:
        port = base.rsplit(":", 1)[1]
        # A rebinding name: the first answer passes the check, later ones point inside.
        answers = iter([[PUBLIC_HOST], ["127.0.0.1"], ["127.0.0.1"]])

        async def rebinding(host: str, port: int) -> list[str]:
            return next(answers)

        fake_dns.real = rebinding
        assert fetch(f"http://rebind.test:{port}/ok.png") == PNG
    assert server.seen == [("/ok.png", f"rebind.test:{port}")]
    assert fake_dns.calls == ["rebind.test"]


def test_https_connects_to_the_checked_ip_with_the_name_in_host_and_sni(fake_dns):
    fake_dns.answers["media.test"] = ["93.184.216.34"]
    sent = []
    transport = httpx.MockTransport(lambda request: sent.append(request)
                                    or httpx.Response(200, content=PNG))
    assert fetch("https://media.test/cat.png", transport=transport) == PNG
    (request,) = sent
    assert (request.url.host, request.url.scheme) == ("93.184.216.34", "https")
    assert request.headers["host"] == "media.test"
    assert request.extensions["sni_hostname"] == "media.test"


def test_allow_list_lets_only_listed_hosts_through_to_any_address():
    server = _recording_handler()
    with loopback_http_server(server) as base:
        port = base.rsplit(":", 1)[1]
        assert fetch(f"http://LocalHost:{port}/ok.png",
                     allowed_media_domains=("localhost",)) == PNG
        with pytest.raises(MediaError, match=r"not in .*\['localhost'\].*--allowed-media-domains"):
            fetch(f"{base}/ok.png", allowed_media_domains=("localhost",))
    with pytest.raises(MediaError, match="'cdn.example.test' is not in"):
        fetch("http://cdn.example.test/cat.png", allowed_media_domains=("example.test",))
    assert server.seen == [("/ok.png", f"localhost:{port}")]


def test_allow_list_applies_to_each_redirect():
    server = _recording_handler()
    with loopback_http_server(server) as base:
        port = base.rsplit(":", 1)[1]
        with pytest.raises(MediaError, match="'127.0.0.1' is not in"):
            fetch(f"http://localhost:{port}/to?{base}/ok.png", allowed_media_domains=("localhost",))
    assert [path for path, _ in server.seen] == [f"/to?{base}/ok.png"]


def test_opting_out_fetches_from_private_addresses():
    with loopback_http_server(_recording_handler()) as base:
        assert fetch(f"{base}/ok.png", allow_private_media_urls=True) == PNG


def _self_signed(tmp_path, name: str) -> tuple[str, str]:
    """(cert.pem, key.pem) of a self-signed certificate for DNS name `name`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@contextlib.contextmanager
def _tls_server(cert: str, key: str):
    """An https server on PUBLIC_HOST presenting `cert`; yields its port."""
    server = http.server.ThreadingHTTPServer((PUBLIC_HOST, 0), _recording_handler())
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("certified_name, fetches", [("media.test", True), ("other.test", False)])
def test_tls_certificate_is_verified_against_the_url_host(tmp_path, fake_dns, public_test_host,
                                                          certified_name, fetches):
    cert, key = _self_signed(tmp_path, certified_name)
    fake_dns.answers["media.test"] = [PUBLIC_HOST]
    trusting = httpx.AsyncHTTPTransport(verify=ssl.create_default_context(cafile=cert))
    with _tls_server(cert, key) as port:
        if fetches:
            assert fetch(f"https://media.test:{port}/ok.png", transport=trusting) == PNG
        else:
            with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED|certificate"):
                fetch(f"https://media.test:{port}/ok.png", transport=trusting)


def test_file_url_through_a_symlinked_folder_out_of_the_allowed_folder_is_refused(tmp_path):
    allowed, secrets = tmp_path / "allowed", tmp_path / "secrets"
    allowed.mkdir()
    secrets.mkdir()
    (secrets / "key.png").write_bytes(PNG)
    os.symlink(secrets, allowed / "escape")
    with pytest.raises(MediaError, match="outside the allowed media folder"):
        fetch(f"file://{allowed}/escape/key.png", allowed_local_media_path=str(allowed))


@pytest.mark.parametrize("suffix", ["/../secret.png", "/%2e%2e/secret.png",
                                    "/sub/../../secret.png", "-evil/secret.png"])
def test_file_url_leaving_the_allowed_folder_by_path_is_refused(tmp_path, suffix):
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (tmp_path / "allowed-evil").mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    (tmp_path / "allowed-evil" / "secret.png").write_bytes(PNG)
    with pytest.raises(MediaError, match="outside the allowed media folder"):
        fetch(f"file://{allowed}{suffix}", allowed_local_media_path=str(allowed))


def test_file_url_with_a_nul_character_is_a_media_error(tmp_path):
    with pytest.raises(MediaError, match="NUL"):
        fetch(f"file://{tmp_path}/a%00b.png", allowed_local_media_path=str(tmp_path))


def test_file_url_through_a_symlink_inside_the_allowed_folder_is_read(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(PNG)
    os.symlink(tmp_path / "images" / "a.png", tmp_path / "alias.png")
    assert fetch(f"file://{tmp_path}/alias.png", allowed_local_media_path=str(tmp_path)) == PNG


def test_the_blocked_kinds_cover_every_non_global_address():
    for network in ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8",
                    "169.254.0.0/16", "172.16.0.0/12", "192.168.0.0/16", "224.0.0.0/4",
                    "240.0.0.0/4", "fc00::/7", "fe80::/10", "ff00::/8"):
        net = ipaddress.ip_network(network)
        for address in (net[0], net[1], net[-2], net[-1]):
            assert blocked_address_kind(str(address)) is not None, address
