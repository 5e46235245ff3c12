"""A stand-in engine process for the serve supervisor's unit tests (no SGLang): a tiny HTTP
server on ``--port``, run as ``python -c SCRIPT --port N`` by the real ``Launcher``.

* ``GET /health``: 200 at once (the start-up check), or after ``$FAKE_HEALTH_DELAY_S`` s (upstream's
  /health sleeps one second before it answers).
* ``GET /memx/status`` (the health probe), only when ``$FAKE_PROBES`` names a file: appends
  its pid to that file, then answers 200 after ``$FAKE_PROBE_DELAY_S`` s (sleeping, or
  computing with ``$FAKE_PROBE_BURN=1``); otherwise 404 like any other path.
* ``POST`` (any path): ``{"pid": <its pid>}``, or ``{"port": <its port>}`` with
  ``$FAKE_ANSWER=port``.
* ``$FAKE_MARKER``: the first start creates that file; every later start exits 3 at once (an
  engine that cannot come back).
"""

from __future__ import annotations

import sys
from pathlib import Path

from sglang_memx.serve.launcher import EngineSpec, free_port

SCRIPT = """
import http.server, json, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
marker = os.environ.get("FAKE_MARKER")
if marker:
    if os.path.exists(marker):
        sys.exit(3)
    open(marker, "w").close()
probes = os.environ.get("FAKE_PROBES")
delay = float(os.environ.get("FAKE_PROBE_DELAY_S", "0"))
answer = {"port": port} if os.environ.get("FAKE_ANSWER") == "port" else {"pid": os.getpid()}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/memx/status" and probes:
            with open(probes, "a") as f:
                f.write(f"{os.getpid()}\\n")
            if os.environ.get("FAKE_PROBE_BURN"):
                end = time.monotonic() + delay
                while time.monotonic() < end:
                    pass
            else:
                time.sleep(delay)
            ok = True
        else:
            ok = self.path == "/health"
            if ok:
                time.sleep(float(os.environ.get("FAKE_HEALTH_DELAY_S", "0")))
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer.allow_reuse_address = True
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake_engine_spec(tmp_path: Path, model: str, env: dict | None = None, replica: int = 0,
                     log_name: str | None = None) -> EngineSpec:  # fmt: skip
    """An ``EngineSpec`` running ``SCRIPT`` on a free port (device ``cpu0``, pool ``pool-x``,
    pool dir and log ``<log_name or model>.log`` in ``tmp_path``); ``env`` as above."""
    port = free_port()
    return EngineSpec(model, "cpu0", "pool-x", str(tmp_path), port, (sys.executable, "-c", SCRIPT, "--port", str(port)),
                      dict(env or {}), str(Path(tmp_path) / f"{log_name or model}.log"), replica)  # fmt: skip
