"""HTTP tools against real servers on 127.0.0.1 (started by the tests, port 0): answers, errors, limits, and
URLs outside the configured bases refused before any connection is made."""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import socket
import threading
import time
import tracemalloc
import zlib
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


def test_shown_as_names_the_service_without_its_port(server):
    """An answer names the service as ``shown_as`` says: the OS picks the test server's port, as it picks a
    local service's at every run, and the text the policy reads must not change with it."""
    fetch = make_http_get([server.url + "/api"], timeout_s=0.5, shown_as="shop")
    port = str(server.server_address[1])
    for path, start in [
        ("missing", "error: HTTP 404 Not Found from shop/api/missing"),
        ("fail", "error: HTTP 500 Internal Server Error from shop/api/fail"),
        ("slow", "error: timed out after 0.5 s waiting for shop/api/slow"),
    ]:
        text = fetch(path)
        assert text.startswith(start) and port not in text, text
    # another host keeps its own name (a redirect's target here)
    assert fetch("redirect").startswith("error: HTTP 302 redirect to http://example.com/steal")
    with pytest.raises(ConfigError, match="shown_as"):
        make_http_get([server.url], shown_as="a/b")


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


# --- red team: servers that try to hold a call past its deadline or blow up the trainer's memory ------------
# Each runs on a raw socket (no HTTP library on the server side), so it can send what no well-behaved server
# would: headers one byte at a time, endless "100 Continue" answers, a body that never ends, compression bombs.


def _read_request(conn: socket.socket) -> bytes:
    """The request's head (up to the blank line), as the server received it."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = conn.recv(4096)
        if not data:
            break
        head += data
    return head


class RawServer:
    """The base URL of a ``raw_server`` and the heads of the requests it received."""

    def __init__(self, url: str):
        self.url = url
        self.requests: list[bytes] = []


@contextlib.contextmanager
def raw_server(behave):
    """A TCP server on 127.0.0.1 that reads each request's head (kept in ``requests``), then hands the
    connection to ``behave(conn, stop)`` in its own thread; ``stop`` is set when the test is done."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()
    server = RawServer(f"http://127.0.0.1:{listener.getsockname()[1]}")

    def handle(conn):
        with conn:
            try:
                server.requests.append(_read_request(conn))
                behave(conn, stop)
            except OSError:  # the client hung up (it gave up on us, as it should)
                pass

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(2)
        listener.close()


def _timed_call(tool, url):
    start = time.monotonic()
    text = tool(url)
    return text, time.monotonic() - start


def _trickled_headers(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(50):  # 10 s of one header byte every 0.2 s: each read waits less than the 0.5 s timeout
        if stop.wait(0.2):
            return
        conn.sendall(b"a")


def _endless_continue(conn, stop):
    for _ in range(100):  # 10 s of interim answers, each a complete response the client must read past
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if stop.wait(0.1):
            return


@pytest.mark.parametrize(
    ("behave", "method"),
    [(_trickled_headers, "GET"), (_endless_continue, "GET"), (_endless_continue, "POST")],
    ids=["trickled-headers", "100-continue", "100-continue-post"],
)
def test_a_server_cannot_hold_the_call_in_the_header_phase(behave, method):
    with raw_server(behave) as server:
        # 0.5 s per wait, 1 s for the whole exchange
        if method == "GET":
            tool = make_http_get([server.url], timeout_s=0.5)
            text, seconds = _timed_call(tool, server.url + "/x")
        else:
            tool = make_http_post_json([server.url], timeout_s=0.5)
            text, seconds = _timed_call(lambda url: tool(url, {"q": 1}), server.url + "/x")
    assert seconds < 2 * 0.5 + 0.5, f"took {seconds:.1f} s: {text}"
    assert seconds < tool.timeout_s
    assert text.startswith("error: timed out"), text
    assert "did not finish answering within 1 s" in text


def _trickled_body(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(10):  # one byte every 0.9 s: each read waits less than the 1 s timeout
        if stop.wait(0.9):
            return
        conn.sendall(b"x")


def test_a_body_trickled_past_the_deadline_is_cut_at_the_deadline():
    with raw_server(_trickled_body) as server:
        # 1 s per wait, 2 s in all: the bytes come at 0.9 and 1.8 s, then the next at 2.7 s is past the deadline
        http_get = make_http_get([server.url], timeout_s=1.0)
        text, seconds = _timed_call(http_get, server.url + "/x")
    assert seconds < 2 * 1.0 + 0.5, f"took {seconds:.1f} s: {text}"
    assert text.startswith("error: timed out"), text
    assert "did not finish answering within 2 s" in text


@functools.cache
def _gzip_bomb(layers: int) -> bytes:
    """100 MB of zeros gzipped (about 100 KB), then gzipped again ``layers - 1`` times (a few hundred bytes)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    body = b"".join([packer.compress(zeros) for _ in range(100)] + [packer.flush()])
    for _ in range(layers - 1):
        body = gzip.compress(body, 9)
    return body


@pytest.mark.parametrize("encoding", ["gzip", "gzip, gzip"])
def test_a_compression_bomb_is_cut_at_max_bytes_of_decoded_data(encoding):
    bomb = _gzip_bomb(encoding.count("gzip"))

    def send_bomb(conn, stop):
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            f"Content-Encoding: {encoding}\r\nContent-Length: {len(bomb)}\r\n\r\n"
        )
        conn.sendall(head.encode() + bomb)

    with raw_server(send_bomb) as server:
        http_get = make_http_get([server.url], timeout_s=5, max_bytes=1000)
        tracemalloc.start()
        try:
            text, seconds = _timed_call(http_get, server.url + "/x")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    body, _, note = text.partition("\n[truncated")
    assert body == "\0" * 1000, text[:200]
    assert note == ": the body is longer than 1000 bytes]"
    assert peak < 10 * 2**20, f"the call allocated up to {peak / 2**20:.0f} MB for a {len(bomb)}-byte answer"
    assert seconds < 5


def test_the_request_asks_for_an_uncompressed_answer():
    def answer(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")

    with raw_server(answer) as server:
        assert make_http_get([server.url])(server.url + "/x") == "ok"
    head = server.requests[0].decode().lower()
    assert "\r\naccept-encoding: identity\r\n" in head, head


def test_a_slow_name_lookup_is_cut_by_the_timeout(monkeypatch):
    release = threading.Event()

    def slow_getaddrinfo(*args, **kwargs):  # a resolver that does not answer (released when the test ends)
        release.wait(10)
        raise socket.gaierror("no answer")

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    http_get = make_http_get(["http://slow.invalid"], timeout_s=0.5)
    try:
        text, seconds = _timed_call(http_get, "http://slow.invalid/x")
    finally:
        release.set()
    assert seconds < 2 * 0.5 + 0.5, f"took {seconds:.1f} s: {text}"
    assert text.startswith("error: timed out after 0.5 s waiting for http://slow.invalid/x"), text


def test_host_names_are_looked_up(server):
    base = server.url.replace("127.0.0.1", "localhost")  # maybe ::1 first, refused: then 127.0.0.1
    assert make_http_get([base + "/api"], timeout_s=2)(base + "/api/text") == "plain text"


def _answer_with(encoding: str, body: bytes, status: str = "200 OK"):
    def answer(conn, stop):
        head = f"HTTP/1.1 {status}\r\nContent-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\n\r\n"
        conn.sendall(head.encode() + body)

    return answer


@pytest.mark.parametrize(
    ("encoding", "body", "expected"),
    [
        ("gzip", gzip.compress(b"hello"), "hello"),
        ("x-gzip", gzip.compress(b"hello"), "hello"),
        ("deflate", zlib.compress(b"hello"), "hello"),
        ("deflate", zlib.compress(b"hello")[2:-4], "hello"),  # raw deflate, as some servers send it
        ("gzip, gzip", gzip.compress(gzip.compress(b"hello")), "hello"),
        ("identity, gzip", gzip.compress(b"hello"), "hello"),
        ("gzip", gzip.compress(b"h" * 300_000), "h" * 300_000),  # several decoded chunks, under max_bytes
    ],
    ids=["gzip", "x-gzip", "deflate", "raw-deflate", "gzip-gzip", "identity-gzip", "gzip-300k"],
)
def test_answers_compressed_anyway_are_decoded(encoding, body, expected):
    with raw_server(_answer_with(encoding, body)) as server:
        assert make_http_get([server.url], max_bytes=400_000)(server.url + "/x") == expected


@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("br", b"\x0b\x02\x80hello\x03", "is compressed (br); this tool cannot read it"),
        ("gzip, gzip, gzip, gzip", b"x", "is compressed (4 layers); this tool cannot read it"),
        ("gzip", b"this is not gzip", "could not decode the compressed answer"),
    ],
    ids=["br", "4-layers", "not-gzip"],
)
def test_unreadable_encodings_are_error_texts(encoding, body, message):
    with raw_server(_answer_with(encoding, body)) as server:
        text = make_http_get([server.url])(server.url + "/x")
    assert text.startswith("error: ") and message in text, text


def test_a_redirect_to_a_broken_url_is_an_error_text():
    def answer(conn, stop):
        conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://[::1\r\nContent-Length: 0\r\n\r\n")

    with raw_server(answer) as server:
        text = make_http_get([server.url])(server.url + "/x")
    assert text.startswith("error: could not get") and "Invalid URL in location header" in text, text
