"""Prometheus ``/metrics`` of the store process over HTTP, from a daemon thread, server side.

``start_http`` serves a ``ServerMetrics`` registry: open (prometheus_client's own server) on
loopback or with ``insecure``; otherwise guarded, answering a scrape only when ``authorize``
(``kvstore.server.main.metrics_authorizer``: an ``admin`` token) says 200, and 401 / 403 /
404 with an empty body else.  Request lines and headers stay out of the log.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.server.metrics import ServerMetrics


def start_http(metrics: ServerMetrics, host: str, port: int, authorize: Callable[[str | None], int] | None = None):
    """Serve ``/metrics`` from a daemon thread; ``(server, bound_port)``.  ``authorize``
    (beyond loopback): the ``Authorization`` header → the HTTP status to answer with (200:
    the metrics; 401, 403: nothing else)."""
    if authorize is None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host.strip("[]"), registry=metrics.registry)
        return server, server.server_address[1]
    return _start_guarded(metrics, host.strip("[]"), port, authorize)


def _start_guarded(metrics: ServerMetrics, host: str, port: int, authorize: Callable[[str | None], int]):
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status = authorize(self.headers.get("Authorization"))
            if self.path.split("?", 1)[0] != "/metrics":
                status = 404 if status == 200 else status
            body = generate_latest(metrics.registry) if status == 200 else b""
            self.send_response(status)
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="kvstore"')
            self.send_header("Content-Type", CONTENT_TYPE_LATEST if status == 200 else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # no request lines (nor headers) in the log
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="kvstore-metrics", daemon=True).start()
    return server, server.server_address[1]


__all__ = ["start_http"]
