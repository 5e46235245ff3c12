"""``benchmark/e2e/chat_burst.py``, the diagnostic chat burst client, counts what it saw."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def test_chat_burst_counts_what_the_client_saw():
    """``chat_burst``: first tokens, finishes and the most requests decoding at once, from a stub
    server streaming three chunks per request (one of the requests never gets a token)."""
    import http.server
    import json

    from benchmark.e2e import chat_burst
    from support.http_stub import serving

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()
            if "#0" not in body["messages"][0]["content"]:
                for word in ("a", "b", "c"):
                    chunk = {"choices": [{"delta": {"content": word}}]}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args):
            pass

    with serving(Handler) as url:
        got = chat_burst.burst(url, 4, 30.0, "m", None)
    assert got["with_first_token"] == 3 and got["finished"] == 4 and got["chunks"] == 9
    assert 1 <= got["most_decoding_at_once"] <= 3
    outcomes = [chat_burst.Outcome(0.0, 5.0, 3), chat_burst.Outcome(1.0, 2.0, 2), chat_burst.Outcome(6.0, 7.0, 1)]
    assert chat_burst.most_at_once(outcomes) == 2
