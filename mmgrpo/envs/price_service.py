"""A shop's price list served over HTTP on 127.0.0.1, for the ``tool_lookup`` env's ``lookup`` tool.

``GET <url>/<item>`` answers ``{"price": 38}`` for an item of the catalogue (numbers ``first`` to
``last``), and 404 with ``{"error": "..."}`` saying which items exist for anything else. The prices are a
pure function of the catalogue seed, so a run, its evaluation and a resumed run see the same shop.

One service per process and catalogue (``shared_price_service``): every env, warm start and evaluation of the
process asks the same server, which runs in a daemon thread (a ``ThreadingHTTPServer``, one thread per
request, so concurrent tool calls do not queue) and stops with the process. It listens on a port the system
picks, on the loopback interface only.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Catalogue", "PriceService", "shared_price_service"]

PATH = "/prices"
"""Where the price list lives on the server."""


@dataclass(frozen=True)
class Catalogue:
    """Items ``first..last`` priced uniformly in ``[low, high]`` by a generator seeded with ``seed``."""

    seed: int = 0
    first: int = 100
    last: int = 999
    low: int = 10
    high: int = 99

    def prices(self) -> dict[int, int]:
        rng = random.Random(f"mmgrpo-price-list-{self.seed}")
        return {item: rng.randint(self.low, self.high) for item in range(self.first, self.last + 1)}


class PriceService:
    """The catalogue's prices behind ``GET http://127.0.0.1:<port>/prices/<item>``; ``url`` is that base."""

    def __init__(self, catalogue: Catalogue) -> None:
        self.catalogue = catalogue
        self.prices = catalogue.prices()
        prices, first, last = self.prices, catalogue.first, catalogue.last

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server name)
                head, _, tail = self.path.partition(PATH + "/")
                item = int(tail) if head == "" and tail.isdigit() and len(tail) <= 6 else None
                if item in prices:
                    # the price alone: with the item echoed too ({"item": 417, "price": 38}) the tiny model's
                    # drills passed at step 500 on seed 0 and stalled at 0.2 after 1100 on seed 1; without
                    # it both pass at step 350
                    self._send(200, {"price": prices[item]})
                else:
                    self._send(
                        404, {"error": f"no item at {self.path[:40]}; items are {PATH}/{first} to {last}"}
                    )

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body, separators=(",", ":")).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the http.server name)
                pass  # one line per request on stderr would drown the training log

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{PATH}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="price-service", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()


_SERVICES: dict[Catalogue, PriceService] = {}
_LOCK = threading.Lock()


def shared_price_service(catalogue: Catalogue) -> PriceService:
    """This process's service for ``catalogue``, started on first use."""
    with _LOCK:
        if catalogue not in _SERVICES:
            _SERVICES[catalogue] = PriceService(catalogue)
        return _SERVICES[catalogue]
