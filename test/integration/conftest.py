"""Integration fixtures shared by every module: the session's shared servers, the wait for
servers released in the background by earlier modules' teardowns, and the soak, started with
the first integration test when it is among the selected ones (``support.background_soak``)."""

from __future__ import annotations

import pytest

from support.background_soak import BackgroundSoak
from support.server import join_released
from support.shared_servers import SharedServers

SOAK_TEST = "test_soak.py::test_one_minute_soak_keeps_every_invariant"
FIRST_MODULE = "test_embedded_model_prepare.py"  # no server: one core busy, the soak's start-up takes the other


def pytest_collection_modifyitems(session, config, items):
    """Run ``FIRST_MODULE`` first among the integration tests (the rest keep their order): its
    transformers generation and its one conversion (the rebuild) compute on one core while the
    soak, begun with it, starts its engines."""
    start = next((i for i, item in enumerate(items) if "test/integration/" in item.nodeid), None)
    if start is None:
        return
    first = [item for item in items[start:] if FIRST_MODULE in item.nodeid]
    items[start:] = first + [item for item in items[start:] if FIRST_MODULE not in item.nodeid]


@pytest.fixture(scope="session")
def shared_servers():
    registry = SharedServers()
    yield registry
    registry.stop()
    join_released()


@pytest.fixture(scope="session", autouse=True)
def background_soak(request, tmp_path_factory):
    """The soak's run, begun before the first integration module's servers; ``None`` when the
    soak test is not selected. Its traffic phase leaves the cores mostly idle, so the modules
    that run meanwhile use them."""
    if not any(item.nodeid.endswith(SOAK_TEST) for item in request.session.items):
        yield None
        return
    soak = BackgroundSoak(tmp_path_factory.mktemp("soak"))
    yield soak
    soak.stop()


@pytest.fixture(scope="session", autouse=True)
def _released_servers_are_gone_at_the_end():
    yield
    join_released()
