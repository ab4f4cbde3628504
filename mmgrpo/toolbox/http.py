"""HTTP tools limited to configured base URLs: ``make_http_get`` and ``make_http_post_json``.

A URL is allowed when its scheme, host and port equal those of one configured base URL and its path lies
under the base's path (``/api`` allows ``/api`` and ``/api/items``, not ``/apix``). Everything else is refused
*before* any connection is made, with a ``ValueError`` naming the allowed bases: other hosts, ports and
schemes (``file://``), user info (``http://127.0.0.1:8000@evil.com`` is a request to ``evil.com``), ``..``
segments, also percent-encoded ones. Redirects are not followed: a 3xx answer is reported with its target,
which the model may request itself, through the same check.

Bounds, whatever the server does: no single wait (connecting, sending, each read) lasts more than
``timeout_s``, and the whole exchange (name lookup, connection, request, headers, any number of interim
``100 Continue`` answers, body) has ``2 * timeout_s``: a server that trickles its headers or body a byte at a
time is cut at that deadline. The request asks for ``Accept-Encoding: identity``; an answer compressed anyway
(``gzip``, ``deflate``, up to three layers) is decoded in bounded steps and reading stops at ``max_bytes`` of
*decoded* data (the text says it was cut), so a compression bomb costs about ``max_bytes`` plus one chunk of
memory. A JSON answer is returned compact; a non-2xx status, a timeout, a failed connection or an unreadable
encoding becomes an ``error: ...`` text: the model's call was fine, the service was not. Proxies from the
environment are ignored.

``httpx`` is imported when a tool is made, not when this module is imported.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import socket
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

__all__ = ["make_http_get", "make_http_post_json"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_TEXT_TYPES = ("application/xml", "application/javascript", "application/x-www-form-urlencoded")
ERROR_BODY_CHARS = 500
"""How much of the body of a non-2xx answer is shown."""
_CHUNK = 64 * 1024
"""The most bytes one decoding step produces, and the size of the pieces a request body is sent in."""
_MAX_LAYERS = 3
"""The most content encodings (``gzip, gzip, ...``) an answer may stack; each costs a decoder's memory."""
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""The content encodings read, and the ``wbits`` of their ``zlib`` decoder."""


class _Policy:
    """The allowed bases and the check every URL goes through."""

    def __init__(self, base_urls: list[str], tool: str, shown_as: str | None = None):
        import httpx

        if isinstance(base_urls, str):
            base_urls = [base_urls]
        if not base_urls:
            raise _config_error(f"{tool}: base_urls is empty; give the URLs the tool may fetch from")
        self.tool = tool
        self.bases = []
        for text in base_urls:
            try:
                url = httpx.URL(str(text))
            except Exception as e:
                raise _config_error(f"{tool}: base URL {text!r} is not a URL ({e})") from None
            if url.scheme not in _DEFAULT_PORTS or not url.host:
                raise _config_error(f"{tool}: base URL {text!r} must be http:// or https:// with a host")
            if url.userinfo or url.query or url.fragment:
                raise _config_error(
                    f"{tool}: base URL {text!r} must not have user info, a query or a fragment"
                )
            self.bases.append((url.scheme, url.host.lower(), _port(url), url.path.rstrip("/")))
        self.first = httpx.URL(str(base_urls[0]).rstrip("/") + "/")
        if shown_as is not None and (
            not isinstance(shown_as, str) or not shown_as.strip() or "/" in shown_as
        ):
            raise _config_error(
                f"{tool}: shown_as={shown_as!r} must be a name without '/', e.g. 'price-service'"
            )
        self.shown_as = shown_as
        self.described = ", ".join(self._show(b) for b in self.bases)
        # made once per tool (loading the CA certificates takes a while), only if an https URL is allowed
        needs_tls = any(scheme == "https" for scheme, *_ in self.bases)
        self.ssl_context = httpx.create_ssl_context(trust_env=False) if needs_tls else None

    @staticmethod
    def _show(base: tuple[str, str, int, str]) -> str:
        scheme, host, port, path = base
        host = f"[{host}]" if ":" in host else host
        port_text = "" if port == _DEFAULT_PORTS[scheme] else f":{port}"
        return f"{scheme}://{host}{port_text}{path}/"

    def show(self, target: Any) -> str:
        """How an answer names ``target``: as it is, or with the first base's scheme, host and port written
        as ``shown_as`` (``price-service/prices/7``): a port the OS picks at every run would otherwise make
        the text the policy reads, and every episode after it, differ from run to run."""
        first = self.first
        if self.shown_as is None or (target.scheme, target.host, _port(target)) != (
            first.scheme,
            first.host,
            _port(first),
        ):
            return str(target)
        return self.shown_as + target.raw_path.decode("ascii")

    def check(self, url: str) -> Any:
        """The ``httpx.URL`` to request, or ValueError saying why not."""
        import httpx

        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"url must be a non-empty string; allowed URLs start with {self.described}")
        try:
            parsed = httpx.URL(url.strip())
            if not parsed.scheme:  # "/api/items" or "items": relative to the first base URL
                parsed = self.first.join(parsed)
        except Exception:
            raise ValueError(
                f"{url[:200]!r} is not a valid URL; allowed URLs start with {self.described}"
            ) from None
        if parsed.userinfo:
            raise ValueError(
                f"URLs with user info ('...@') are refused; allowed URLs start with {self.described}"
            )
        path = unquote(parsed.path)
        if any(segment in ("..", ".") for segment in path.replace("\\", "/").split("/")):
            raise ValueError(f"'..' in the path is refused; allowed URLs start with {self.described}")
        key = (parsed.scheme, (parsed.host or "").lower(), _port(parsed))
        for scheme, host, port, base_path in self.bases:
            if key == (scheme, host, port) and (path == base_path or path.startswith(base_path + "/")):
                return parsed
        raise ValueError(f"the URL {url[:200]!r} is not allowed: allowed URLs start with {self.described}")


def _port(url: Any) -> int | None:
    return url.port if url.port is not None else _DEFAULT_PORTS.get(url.scheme)


def _config_error(message: str) -> Exception:
    from mmgrpo.errors import ConfigError

    return ConfigError(message)


def make_http_get(
    base_urls: list[str],
    *,
    timeout_s: float = 5.0,
    max_bytes: int = 20_000,
    name: str = "http_get",
    headers: dict[str, str] | None = None,
    shown_as: str | None = None,
) -> Callable[[str], str]:
    """The ``http_get(url)`` tool, allowed to fetch only under ``base_urls`` (see the module docstring).

    ``timeout_s`` bounds each wait, and twice that the whole exchange. The function carries ``timeout_s``
    (``2 * timeout_s + 1``): the longest one call can take; give the tool runner at least that much.
    ``shown_as`` names the first base URL's scheme, host and port in the answers (see ``_Policy.show``).
    """
    _check_settings(name, timeout_s, max_bytes)
    policy = _Policy(base_urls, name, shown_as)

    def http_get(url: str) -> str:
        return _request(policy, "GET", url, None, timeout_s, max_bytes, headers)

    http_get.__doc__ = f"""Fetch a URL with HTTP GET and return the response body (JSON is returned compact).

    Allowed URLs start with {policy.described}; relative URLs are resolved against {policy.first}.

    Args:
        url: The URL to fetch, e.g. "{policy.first}".
    """
    return _named(http_get, name, timeout_s)


def make_http_post_json(
    base_urls: list[str],
    *,
    timeout_s: float = 5.0,
    max_bytes: int = 20_000,
    name: str = "http_post",
    headers: dict[str, str] | None = None,
    shown_as: str | None = None,
) -> Callable[[str, dict], str]:
    """The ``http_post(url, data)`` tool: POSTs ``data`` as JSON, under the same rules as :func:`make_http_get`."""
    _check_settings(name, timeout_s, max_bytes)
    policy = _Policy(base_urls, name, shown_as)

    def http_post(url: str, data: dict) -> str:
        return _request(policy, "POST", url, data, timeout_s, max_bytes, headers)

    http_post.__doc__ = f"""Send a JSON object with HTTP POST and return the response body (JSON is returned compact).

    Allowed URLs start with {policy.described}; relative URLs are resolved against {policy.first}.

    Args:
        url: The URL to post to, e.g. "{policy.first}".
        data: The JSON object to send as the request body.
    """
    return _named(http_post, name, timeout_s)


def _check_settings(name: str, timeout_s: float, max_bytes: int) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise _config_error(f"tool name {name!r} must be an identifier like 'http_get'")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise _config_error(f"{name}: timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise _config_error(f"{name}: max_bytes must be a positive int, got {max_bytes!r}")


def _named(fn: Callable[..., str], name: str, timeout_s: float) -> Callable[..., str]:
    fn.__name__ = fn.__qualname__ = name
    fn.timeout_s = 2 * timeout_s + 1  # type: ignore[attr-defined]
    return fn


def _request(
    policy: _Policy,
    method: str,
    url: str,
    data: dict | None,
    timeout_s: float,
    max_bytes: int,
    headers: dict[str, str] | None,
) -> str:
    import httpx

    target = policy.check(url)
    shown = policy.show(target)
    if method == "POST" and not isinstance(data, dict):
        raise ValueError(f"data must be a JSON object, got {type(data).__name__}")
    # The whole exchange gets 2 * timeout_s. httpx's timeouts are per wait (a server sending one byte, or
    # one "100 Continue", every timeout_s - 0.01 s never trips them), so the network layer under httpx
    # (``_Budget``) gives every single wait at most what is left of the total and fails once nothing is
    # left: the deadline holds in the header phase too, where no loop of ours runs. This runs in the
    # caller's thread; a watchdog thread closing the socket at the deadline would race with the reading
    # thread (close() does not wake a blocked read on Linux, and the descriptor's number can be reused).
    total = 2 * timeout_s
    budget = _Budget(total)
    body, cut = bytearray(), False
    try:
        with httpx.Client(
            transport=_transport(budget, policy.ssl_context),
            timeout=timeout_s,
            follow_redirects=False,
            trust_env=False,
            headers={"Accept-Encoding": "identity"},  # the configured ``headers`` may still ask otherwise
        ) as client:
            with client.stream(method, target, json=data, headers=headers) as response:
                codings = [
                    c.strip().lower()
                    for c in response.headers.get_list("content-encoding", split_commas=True)
                    if c.strip().lower() not in ("", "identity")
                ]
                unreadable = [c for c in codings if c not in _DECODERS]
                if unreadable or len(codings) > _MAX_LAYERS:
                    what = ", ".join(codings) if len(codings) <= _MAX_LAYERS else f"{len(codings)} layers"
                    return f"error: the answer from {shown} is compressed ({what}); this tool cannot read it"
                chunks = response.iter_raw()
                for coding in reversed(codings):  # the last encoding applied is undone first
                    chunks = _inflate(chunks, coding)
                for chunk in chunks:  # decoded data, never more than _CHUNK bytes at a time
                    body += chunk
                    if len(body) > max_bytes:
                        del body[max_bytes:]
                        cut = True
                        break
                    if budget.left() <= 0:
                        budget.expired = True
                        break
                if budget.expired:
                    return _out_of_time(shown, total)
    except Exception as e:  # every failure of the exchange is data for the model, never raised
        if budget.expired:
            return _out_of_time(shown, total)
        if isinstance(e, zlib.error):
            return f"error: could not decode the compressed answer from {shown}: {e}"
        if _is_timeout(e):
            return f"error: timed out after {timeout_s:g} s waiting for {shown}"
        return f"error: could not get {shown}: {type(e).__name__}: {e}"
    try:
        return _describe(response, target, policy, bytes(body), cut, max_bytes)
    except Exception as e:  # a header httpx cannot make sense of, say
        return f"error: could not read the answer from {shown}: {type(e).__name__}: {e}"


def _out_of_time(target: Any, total: float) -> str:
    return f"error: timed out: {target} did not finish answering within {total:g} s"


def _is_timeout(e: Exception) -> bool:
    import httpcore
    import httpx

    return isinstance(e, (httpx.TimeoutException, httpcore.TimeoutException))


def _inflate(chunks: Any, coding: str) -> Any:
    """Undo one layer of ``gzip`` or ``deflate`` on a stream of chunks, yielding at most ``_CHUNK`` bytes at
    a time however much the input expands (``zlib``'s ``max_length``; the rest of the input waits in
    ``unconsumed_tail``), so the reader can stop at its limit having held one chunk per layer. Data after the
    end of the compressed stream is ignored, as httpx does."""
    wbits = _DECODERS[coding]
    decoder = zlib.decompressobj(wbits)
    started = False
    for data in chunks:
        while not decoder.eof:
            try:
                out = decoder.decompress(data, _CHUNK)
            except zlib.error:
                if coding != "deflate" or started:
                    raise
                decoder = zlib.decompressobj(-zlib.MAX_WBITS)  # raw deflate, without the zlib wrapper
                started = True
                continue
            started = True
            data = decoder.unconsumed_tail
            if out:
                yield out
            if not data and len(out) < _CHUNK:  # input used up and nothing held back: the next chunk
                break
        if decoder.eof:
            return


class _Budget:
    """What is left of the exchange's total time; ``expired`` once a wait was cut short by it."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.expired = False

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def wait(self, timeout: float | None, error: type[Exception], call: Callable[[float], Any]) -> Any:
        """``call(seconds)``, a blocking step allowed ``timeout`` seconds but never more than is left; raises
        ``error`` (an httpcore timeout) at once when nothing is left."""
        left = self.left()
        if left <= 0:
            self.expired = True
            raise error("the deadline for the whole exchange has passed")
        capped = timeout is None or left < timeout
        try:
            return call(left if capped else timeout)
        except error:
            self.expired = self.expired or capped
            raise


class _Stream:
    """An httpcore network stream whose every read, write and TLS handshake is limited by the budget."""

    def __init__(self, stream: Any, budget: _Budget):
        self._stream, self._budget = stream, budget

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        import httpcore

        return self._budget.wait(timeout, httpcore.ReadTimeout, lambda t: self._stream.read(max_bytes, t))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        import httpcore

        # in pieces, each within the budget: a slow reader cannot stretch one long send past the deadline
        for i in range(0, len(buffer), _CHUNK):
            piece = buffer[i : i + _CHUNK]
            self._budget.wait(timeout, httpcore.WriteTimeout, lambda t, p=piece: self._stream.write(p, t))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> Any:
        import httpcore

        def handshake(t: float) -> Any:
            return self._stream.start_tls(ssl_context, server_hostname, t)

        return _Stream(self._budget.wait(timeout, httpcore.ConnectTimeout, handshake), self._budget)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend:
    """httpcore's network backend, with the name lookup and every connection attempt within the budget."""

    def __init__(self, budget: _Budget):
        import httpcore

        self._budget, self._backend = budget, httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> _Stream:
        import httpcore

        error: Exception | None = None
        for address in self._addresses(host, port, timeout):
            try:
                stream = self._budget.wait(
                    timeout,
                    httpcore.ConnectTimeout,
                    lambda t, a=address: self._backend.connect_tcp(a, port, t, local_address, socket_options),
                )
                return _Stream(stream, self._budget)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                if self._budget.expired:
                    raise
                error = e  # the next address, if any
        assert error is not None
        raise error

    def _addresses(self, host: str, port: int, timeout: float | None) -> list[str]:
        """The host's addresses. ``getaddrinfo`` takes no timeout and cannot be interrupted, so a name is
        looked up in a daemon thread that is left behind if it takes too long (it ends when the resolver
        gives up; it holds no socket of ours)."""
        import httpcore

        try:
            ipaddress.ip_address(host)
            return [host]
        except ValueError:
            pass
        found: dict[str, Any] = {}
        done = threading.Event()

        def look_up() -> None:
            try:
                found["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except Exception as e:
                found["error"] = e
            finally:
                done.set()

        threading.Thread(target=look_up, name=f"http tool: resolve {host}", daemon=True).start()

        def wait(seconds: float) -> None:
            if not done.wait(seconds):
                raise httpcore.ConnectTimeout(f"looking up {host} took more than {seconds:.3g} s")

        self._budget.wait(timeout, httpcore.ConnectTimeout, wait)
        if "error" in found:
            raise httpcore.ConnectError(f"could not look up {host}: {found['error']}")
        return list(dict.fromkeys(str(info[4][0]) for info in found["infos"]))

    def sleep(self, seconds: float) -> None:  # used by httpcore between retries (none are configured)
        time.sleep(max(0.0, min(seconds, self._budget.left())))


def _transport(budget: _Budget, ssl_context: Any) -> Any:
    """An httpx transport over httpcore's connection pool with the budgeted network backend. httpx's own
    ``HTTPTransport`` takes no network backend, so this is its ``handle_request`` again, in public API only;
    httpcore's exceptions come through as they are (``_request`` turns every exception into text)."""
    import httpcore

    pool = httpcore.ConnectionPool(ssl_context=ssl_context, network_backend=_Backend(budget))
    return _transport_class()(pool)


@functools.cache
def _transport_class() -> type:
    import httpcore
    import httpx

    class Body(httpx.SyncByteStream):
        def __init__(self, stream: Any):
            self._stream = stream

        def __iter__(self) -> Any:
            yield from self._stream

        def close(self) -> None:
            self._stream.close()

    class Transport(httpx.BaseTransport):
        def __init__(self, pool: Any):
            self._pool = pool

        def handle_request(self, request: Any) -> Any:
            url = request.url
            response = self._pool.handle_request(
                httpcore.Request(
                    method=request.method,
                    url=httpcore.URL(
                        scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
                    ),
                    headers=request.headers.raw,
                    content=request.stream,
                    extensions=request.extensions,
                )
            )
            return httpx.Response(
                status_code=response.status,
                headers=response.headers,
                stream=Body(response.stream),
                extensions=response.extensions,
            )

        def close(self) -> None:
            self._pool.close()

    return Transport


def _describe(response: Any, target: Any, policy: _Policy, body: bytes, cut: bool, max_bytes: int) -> str:
    status = response.status_code
    if 300 <= status < 400:
        location = response.headers.get("location", "")
        where = f" to {policy.show(target.join(location))}" if location else ""
        return (
            f"error: HTTP {status} redirect{where}; redirects are not followed: "
            "request that URL yourself if it is allowed"
        )
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        text = body.decode(response.encoding or "utf-8", errors="replace")
    except LookupError:  # an unknown charset name
        text = body.decode("utf-8", errors="replace")
    note = f"\n[truncated: the body is longer than {max_bytes} bytes]" if cut else ""
    if not 200 <= status < 300:
        reason = f" {response.reason_phrase}" if response.reason_phrase else ""
        shown = text[:ERROR_BODY_CHARS] + ("..." if len(text) > ERROR_BODY_CHARS or cut else "")
        return f"error: HTTP {status}{reason} from {policy.show(target)}" + (
            f": {shown}" if shown.strip() else ""
        )
    if content_type == "application/json" or content_type.endswith("+json"):
        if cut:
            return text + note
        try:
            return json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
        except ValueError:
            return f"error: the answer says {content_type} but is not valid JSON; the raw body:\n{text}"
    is_text = not content_type or content_type.startswith("text/") or content_type in _TEXT_TYPES
    if not (is_text or content_type.endswith("+xml")):
        size = f"more than {max_bytes}" if cut else str(len(body))
        return f"error: the answer is {content_type} ({size} bytes), not text; this tool only reads text"
    return text + note
