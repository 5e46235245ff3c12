"""Integration fixtures shared by every module: the session's shared servers, and the wait for
servers released in the background by earlier modules' teardowns."""

from __future__ import annotations

import pytest

from support.server import join_released
from support.shared_servers import SharedServers


@pytest.fixture(scope="session")
def shared_servers():
    registry = SharedServers()
    yield registry
    registry.stop()
    join_released()


@pytest.fixture(scope="session", autouse=True)
def _released_servers_are_gone_at_the_end():
    yield
    join_released()
