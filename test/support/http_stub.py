"""A local HTTP server for unit tests that need something to answer over the network (a stub
router, gateway or engine): ``serving(Handler)`` runs ``Handler`` on a free port of 127.0.0.1 in a
daemon thread and yields its base URL. Invariant: on exit the server has stopped and its socket is
closed, whatever the test did."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
