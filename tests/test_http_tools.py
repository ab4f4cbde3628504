"""HTTP tools against real servers on 127.0.0.1 (started by the tests, port 0): answers, errors, limits, and
URLs outside the configured bases refused before any connection is made."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmgrpo.errors import ConfigError
from mmgrpo.toolbox.http import make_http_get, make_http_post_json


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output quiet
        pass

    def send(self, status, body: bytes, content_type="text/plain", headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers:
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.server.seen.append(("GET", self.path))
        try:
            self.route()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeouts, truncation)
            pass

    def do_POST(self):
        self.server.seen.append(("POST", self.path))
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self.send(200, json.dumps({"got": json.loads(data)}).encode(), "application/json")

    def route(self):
        path = self.path
        if path == "/api/json":
            self.send(200, b'{"answer": 42,  "items": [1, 2, 3], "name": "caf\xc3\xa9"}', "application/json")
        elif path == "/api/text":
            self.send(200, b"plain text", "text/plain; charset=utf-8")
        elif path == "/api/fail":
            self.send(500, b"boom: the database is down", "text/plain")
        elif path == "/api/missing":
            self.send(404, b"", "text/plain")
        elif path == "/api/slow":
            time.sleep(1.5)
            self.send(200, b"too late")
        elif path == "/api/big":
            self.send(200, b"x" * 100_000, "text/plain")
        elif path == "/api/bigjson":
            self.send(200, json.dumps(list(range(50_000))).encode(), "application/json")
        elif path == "/api/badjson":
            self.send(200, b"{not json at all", "application/json")
        elif path == "/api/redirect":
            self.send(302, b"", headers=[("Location", "http://example.com/steal")])
        elif path == "/api/image":
            self.send(200, b"\x89PNG\r\n\x1a\n" + bytes(100), "image/png")
        elif path == "/api/trickle":  # headers at once, then one byte every 0.1 s for a long time
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b".")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send(200, b"other")


@pytest.fixture
def server():
    """A server on 127.0.0.1; ``server.seen`` lists the (method, path) of every request it received."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.seen = []
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def http_get(server):
    return make_http_get([server.url + "/api"], timeout_s=0.5, max_bytes=1000)


def test_json_is_returned_compact(http_get, server):
    assert http_get(server.url + "/api/json") == '{"answer":42,"items":[1,2,3],"name":"café"}'
    assert server.seen == [("GET", "/api/json")]


def test_text_and_relative_urls(http_get, server):
    assert http_get(server.url + "/api/text") == "plain text"
    assert http_get("text") == "plain text"  # relative to the base URL
    assert http_get("/api/text") == "plain text"


def test_server_error_gives_the_status(http_get, server):
    text = http_get(server.url + "/api/fail")
    assert text.startswith("error: HTTP 500 Internal Server Error")
    assert "the database is down" in text
    assert http_get(server.url + "/api/missing").startswith("error: HTTP 404 Not Found")


def test_slow_answer_times_out(http_get, server):
    start = time.monotonic()
    text = http_get(server.url + "/api/slow")
    assert time.monotonic() - start < 1.4
    assert text.startswith("error: timed out after 0.5 s")


def test_trickling_answer_is_cut_by_the_total_deadline(http_get, server):
    start = time.monotonic()
    text = http_get(server.url + "/api/trickle")
    assert time.monotonic() - start < 2.0
    assert "did not finish answering within 1 s" in text


def test_big_body_is_truncated(http_get, server):
    text = http_get(server.url + "/api/big")
    assert text.startswith("x" * 1000)
    assert text.count("x") == 1000
    assert "[truncated: the body is longer than 1000 bytes]" in text


def test_big_json_is_truncated_raw(http_get, server):
    text = http_get(server.url + "/api/bigjson")
    assert text.startswith("[0, 1, 2")
    assert "truncated" in text


def test_invalid_json_is_reported_with_the_raw_body(http_get, server):
    text = http_get(server.url + "/api/badjson")
    assert "not valid JSON" in text and "{not json at all" in text


def test_redirects_are_not_followed(http_get, server):
    text = http_get(server.url + "/api/redirect")
    assert text.startswith("error: HTTP 302 redirect to http://example.com/steal")
    assert "not followed" in text
    assert server.seen == [("GET", "/api/redirect")]


def test_binary_answer_is_not_returned(http_get, server):
    assert "image/png" in http_get(server.url + "/api/image")


def test_connection_refused_is_an_error_text():
    # a port that was just free: nothing listens there
    with ThreadingHTTPServer(("127.0.0.1", 0), Handler) as closed:
        url = f"http://127.0.0.1:{closed.server_address[1]}"
    assert make_http_get([url])(url + "/x").startswith("error: could not get")


def test_other_hosts_ports_and_paths_are_refused(server):
    other = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    other.daemon_threads = True
    other.seen = []
    threading.Thread(target=other.serve_forever, args=(0.05,), daemon=True).start()
    try:
        other_url = f"http://127.0.0.1:{other.server_address[1]}"
        host_port = server.url.removeprefix("http://")
        http_get = make_http_get([server.url + "/api"], timeout_s=0.5)
        refused = [
            other_url + "/api/json",  # another port
            "//" + other_url.removeprefix("http://") + "/api/json",  # scheme-relative: the other server
            f"http://{host_port}@{other_url.removeprefix('http://')}/api/json",  # userinfo: really the other server
            f"http://user:pw@{host_port}/api/json",
            server.url.replace("127.0.0.1", "localhost") + "/api/json",  # another host name
            server.url.replace("http:", "https:") + "/api/json",  # another scheme
            server.url + "/secret",  # outside the base path
            server.url + "/apix",  # a prefix of the name is not the path
            server.url + "/api/../secret",
            server.url + "/api/%2e%2e/secret",
            "file:///etc/passwd",
            "ftp://127.0.0.1/",
            "http://[::1]/api",
            "",
            "http://",
        ]
        for url in refused:
            with pytest.raises(ValueError, match="allowed URLs start with " + server.url + "/api/"):
                http_get(url)
        assert other.seen == []
        assert server.seen == []
    finally:
        other.shutdown()
        other.server_close()


def test_post_json(server):
    post = make_http_post_json([server.url + "/api"], name="submit")
    assert post.__name__ == "submit"
    assert post(server.url + "/api/echo", {"x": [1, 2]}) == '{"got":{"x":[1,2]}}'
    assert server.seen == [("POST", "/api/echo")]
    with pytest.raises(ValueError, match="not allowed"):
        post(server.url + "/other", {"x": 1})
    with pytest.raises(ValueError, match="JSON object"):
        post(server.url + "/api/echo", [1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bases", "message"),
    [
        ([], "empty"),
        (["127.0.0.1:8000"], "http:// or https://"),
        (["file:///tmp"], "http:// or https://"),
        (["http://u:p@127.0.0.1/"], "user info"),
        (["http://127.0.0.1/?q=1"], "query"),
    ],
)
def test_bad_base_urls_are_config_errors(bases, message):
    with pytest.raises(ConfigError, match=message):
        make_http_get(bases)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_bytes": "10"}, "max_bytes"),
        ({"name": "http get"}, "identifier"),
    ],
)
def test_bad_settings_are_config_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        make_http_get(["http://127.0.0.1:8000"], **settings)
