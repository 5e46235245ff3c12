"""The suite's one-minute soak, run beside the other integration modules.

After its start-up (four engines, both cores for about 85 s) the soak's traffic leaves the
2-core box about 70 % idle for its two minutes of load and quiet checks; run after the other
modules it cost the suite about 200 s of wall time, run beside them about its start-up's share.
``BackgroundSoak`` starts ``benchmark/soak.py`` in its own process group with its output in a
file (a pipe nobody reads would block it) when constructed, ``result`` waits for it and reads its JSON; ``stop``
ends a run still going (the soak's ``sglang-memx serve`` stops its engines when it dies).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.server import LOG_DIR, REPO

DURATION_S = 60
WARMUP_S = 10


class BackgroundSoak:
    """One soak run, started when constructed; ``result`` blocks for it, ``stop`` is idempotent."""

    def __init__(self, results_dir: Path):
        self.results_dir = Path(results_dir)
        self.log_path = LOG_DIR / "soak-driver.log"
        self.doc_path = self.results_dir / "soak_ci.json"
        LOG_DIR.mkdir(exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True)  # fmt: skip
        self.started = time.monotonic()

    def command(self) -> list[str]:
        # Greedy probes are held to the answers serve gave at start (--stock-reference off): three
        # stock servers first would cost the box about 75 s; memx-under-serve's greedy answers equal
        # to stock's are checked by test_serve_router.py. The script's own runs keep the reference.
        return [sys.executable, str(REPO / "benchmark" / "soak.py"), "--duration-s", str(DURATION_S),
                "--warmup-s", str(WARMUP_S), "--results-dir", str(self.results_dir), "--out", "soak_ci",
                "--stock-reference", "off"]  # fmt: skip

    def result(self, timeout_s: float) -> tuple[int, dict | None, str]:
        """``(exit code, the run's JSON or None, the end of its output)``; a run past ``timeout_s``
        (counted from its start) is stopped and reported as exit code -1."""
        try:
            code = self.proc.wait(max(1.0, timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            code = -1
        tail = self.log_path.read_text(errors="replace")[-4000:]
        doc = json.loads(self.doc_path.read_text()) if self.doc_path.exists() else None
        return code, doc, tail

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
