"""Remote media never reach the server's own network (issue 50): with ``serve.allow_remote_media``
on, a URL whose host is (or resolves to, or redirects to) a loopback, private, link-local or
multicast address is refused before any connection, unless ``serve.allowed_media_domains`` names it."""

from __future__ import annotations

import io
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from PIL import Image

from pipeline.errors import UserError
from pipeline.serve.fetch import RefusedAddress, _public, fetch
from pipeline.serve.media import MediaPolicy, image_from_url
from tests.serving import serving


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (220, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


class _Site(BaseHTTPRequestHandler):
    """``/red.png`` (an image) and ``/hop`` (a redirect to ``/red.png`` on 127.0.0.1); counts hits."""

    hits: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.hits[self.path] = self.hits.get(self.path, 0) + 1
        if self.path == "/hop":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/red.png")
            self.end_headers()
            return
        body = _png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def site():
    _Site.hits = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Site)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port, _Site.hits
    server.shutdown()
    server.server_close()


def _refused(url: str, allowed: frozenset[str] = frozenset()) -> RefusedAddress:
    with pytest.raises(urllib.error.URLError) as caught:
        fetch(url, 1 << 20, allowed)
    assert isinstance(caught.value.reason, RefusedAddress), caught.value
    return caught.value.reason


def test_loopback_by_address_or_by_name_is_refused_before_connecting(site):
    port, hits = site
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]", "0.0.0.0"):
        _refused(f"http://{host}:{port}/red.png")
    _refused(f"https://localhost:{port}/red.png")  # https goes through the same check
    assert hits == {}


def test_private_link_local_and_multicast_addresses_are_refused():
    for host in ("10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254", "[fe80::1]", "[::1]", "224.0.0.1"):
        assert "non-public" in str(_refused(f"http://{host}/a.png"))
    assert _public("8.8.8.8") and _public("2001:4860:4860::8888")
    assert not _public("100.64.0.1")  # carrier-grade NAT: shared, not global


def test_a_named_host_is_fetched_but_a_redirect_to_loopback_is_not(site):
    port, hits = site
    allowed = frozenset({"localhost"})
    assert fetch(f"http://localhost:{port}/red.png", 1 << 20, allowed) == _png()
    reason = _refused(f"http://localhost:{port}/hop", allowed)  # the second hop is 127.0.0.1, not named
    assert "127.0.0.1" in str(reason)
    assert hits == {"/red.png": 1, "/hop": 1}  # the redirect's target was never requested


def test_the_media_error_is_one_line_naming_the_part(site):
    port, _ = site
    policy = MediaPolicy(allow_remote=True)
    with pytest.raises(UserError, match=r"^messages\[0\]\.content\[0\]: http://127\.0\.0\.1:\d+/red\.png not fetched"):
        image_from_url(f"http://127.0.0.1:{port}/red.png", "messages[0].content[0]", policy)
    named = MediaPolicy(allow_remote=True, allowed_domains=frozenset({"localhost"}))
    assert image_from_url(f"http://localhost:{port}/red.png", "x", named).size == (32, 32)


@pytest.mark.slow  # suite time (a server of its own); the guard itself is tested above, in-process
def test_the_server_answers_400_and_never_fetches(site, tmp_path):
    port, hits = site

    def ask(url: str) -> httpx.Response:
        image = {"type": "image_url", "image_url": {"url": url}}
        message = {"role": "user", "content": [image, {"type": "text", "text": "What shapes are in the image?"}]}
        return httpx.post(
            server.url + "/v1/chat/completions", json={"messages": [message], "max_tokens": 3}, timeout=120
        )

    with serving(tmp_path, "serve.allow_remote_media=true", "serve.allowed_media_domains=[localhost]") as server:
        for url in (f"http://127.0.0.1:{port}/red.png", f"http://localhost:{port}/hop"):
            answer = ask(url)
            assert answer.status_code == 400, answer.text
            assert "not fetched" in answer.json()["error"]["message"]
        assert "/red.png" not in hits
        assert ask(f"http://localhost:{port}/red.png").status_code == 200  # named in allowed_media_domains
