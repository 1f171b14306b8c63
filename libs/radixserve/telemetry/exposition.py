"""The `/metrics` HTTP port of a service that has no HTTP server of its own.

    server = MetricsServer.start(registry, host="127.0.0.1", port=9101)
    ...                                   # GET http://127.0.0.1:9101/metrics
    server.close()

The text format (0.0.4) on a threading WSGI server in a daemon thread: a scrape never
touches the service's event loop, and a busy port fails the start at once (OSError).
One format whatever the scraper's Accept header asks for, as the gateway's /metrics:
prometheus_client's own app negotiates, and Prometheus 2.x's header made it rename
every `radixserve:*` series to `radixserve_*`, which the dashboards do not query.
The server polls for shutdown every 50 ms, so stopping a service is not held up.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import ThreadingWSGIServer

from radixserve.telemetry.common import CONTENT_TYPE, render

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

_POLL_S = 0.05


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line per scrape
        pass


class _Server(ThreadingWSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def metrics_app(registry: CollectorRegistry) -> WsgiApp:
    """Every path and method answers the registry in the text format."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = render(registry)
        headers = [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    return app


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread
    host: str

    @classmethod
    def start(cls, registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
        if not 0 < port <= 65535:
            raise ValueError(f"metrics port must be in [1, 65535], got {port}")
        server_class = _Server6 if ":" in host else _Server
        server = make_server(
            host, port, metrics_app(registry), server_class, handler_class=_QuietHandler
        )
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            name="metrics-http",
            daemon=True,
        )
        thread.start()
        return cls(server, thread, host)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout_s: float = 2.0) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout_s)
