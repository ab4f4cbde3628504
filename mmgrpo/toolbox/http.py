"""HTTP tools limited to configured base URLs: ``make_http_get`` and ``make_http_post_json``.

A URL is allowed when its scheme, host and port equal those of one configured base URL and its path lies
under the base's path (``/api`` allows ``/api`` and ``/api/items``, not ``/apix``). Everything else is refused
*before* any connection is made, with a ``ValueError`` naming the allowed bases: other hosts, ports and
schemes (``file://``), user info (``http://127.0.0.1:8000@evil.com`` is a request to ``evil.com``), ``..``
segments, also percent-encoded ones. Redirects are not followed: a 3xx answer is reported with its target,
which the model may request itself, through the same check.

The body is streamed and reading stops at ``max_bytes`` (the text says it was cut); a JSON answer is returned
compact; a non-2xx status, a timeout (per read, and for the whole answer) or a failed connection becomes an
``error: ...`` text: the model's call was fine, the service was not. Proxies from the environment are ignored.

``httpx`` is imported when a tool is made, not when this module is imported.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

__all__ = ["make_http_get", "make_http_post_json"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_TEXT_TYPES = ("application/xml", "application/javascript", "application/x-www-form-urlencoded")
ERROR_BODY_CHARS = 500
"""How much of the body of a non-2xx answer is shown."""


class _Policy:
    """The allowed bases and the check every URL goes through."""

    def __init__(self, base_urls: list[str], tool: str):
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
        self.described = ", ".join(self._show(b) for b in self.bases)

    @staticmethod
    def _show(base: tuple[str, str, int, str]) -> str:
        scheme, host, port, path = base
        host = f"[{host}]" if ":" in host else host
        port_text = "" if port == _DEFAULT_PORTS[scheme] else f":{port}"
        return f"{scheme}://{host}{port_text}{path}/"

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
) -> Callable[[str], str]:
    """The ``http_get(url)`` tool, allowed to fetch only under ``base_urls`` (see the module docstring).

    The function carries ``timeout_s`` (twice the read timeout, plus one second): the longest one call can
    take; give the tool runner at least that much.
    """
    _check_settings(name, timeout_s, max_bytes)
    policy = _Policy(base_urls, name)

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
) -> Callable[[str, dict], str]:
    """The ``http_post(url, data)`` tool: POSTs ``data`` as JSON, under the same rules as :func:`make_http_get`."""
    _check_settings(name, timeout_s, max_bytes)
    policy = _Policy(base_urls, name)

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
    if method == "POST" and not isinstance(data, dict):
        raise ValueError(f"data must be a JSON object, got {type(data).__name__}")
    deadline = time.monotonic() + 2 * timeout_s  # for the whole answer: a slow trickle cannot hold us
    body, cut = bytearray(), False
    try:
        with httpx.Client(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
            with client.stream(method, target, json=data, headers=headers) as response:
                for chunk in response.iter_bytes():
                    body += chunk
                    if len(body) > max_bytes:
                        del body[max_bytes:]
                        cut = True
                        break
                    if time.monotonic() > deadline:
                        return f"error: {target} did not finish answering within {2 * timeout_s:g} s"
    except httpx.TimeoutException:
        return f"error: timed out after {timeout_s:g} s waiting for {target}"
    except httpx.HTTPError as e:
        return f"error: could not get {target}: {type(e).__name__}: {e}"
    return _describe(response, target, bytes(body), cut, max_bytes)


def _describe(response: Any, target: Any, body: bytes, cut: bool, max_bytes: int) -> str:
    status = response.status_code
    if 300 <= status < 400:
        location = response.headers.get("location", "")
        where = f" to {target.join(location)}" if location else ""
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
        return f"error: HTTP {status}{reason} from {target}" + (f": {shown}" if shown.strip() else "")
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
