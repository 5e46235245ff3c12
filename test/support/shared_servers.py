"""Servers started once per test session and shared by every module that asks for the same spec
(issue 27 item 6: a server's start-up costs 15-30 s of the 2-core box; a stock reference server
with the same arguments answers every module the same).

``SharedServers.get(candidate)`` returns the server registered under ``candidate.spec_key()`` (the
argv without the port, stock or memx, the environment it adds), registering the candidate when it
is the first. The module passes what it got to ``start_all`` with its own servers: a running
shared server is only waited for, and ``stop_all`` / ``release_all`` leave it to the session.

Invariant: a test only sends requests to a shared server; it never kills or reconfigures it and
never reads its counters as if they started at zero. Servers that a test kills, fills or measures
stay the module's own."""

from __future__ import annotations

from support.server import SGLangServer, stop_all


class SharedServers:
    def __init__(self) -> None:
        self._by_spec: dict[tuple, SGLangServer] = {}

    def get(self, candidate: SGLangServer) -> SGLangServer:
        key = candidate.spec_key()
        server = self._by_spec.setdefault(key, candidate)
        server.shared = True
        return server

    def __len__(self) -> int:
        return len(self._by_spec)

    def stop(self) -> None:
        servers = list(self._by_spec.values())
        for s in servers:
            s.shared = False
        stop_all(servers)
        self._by_spec.clear()
