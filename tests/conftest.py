"""Shared fixtures: the tiny test model, a live tiny dlora server, and the HF + PEFT oracle."""

from __future__ import annotations

import pytest

from tests import harness
from tests.oracle import HFOracle

ADMIN_TOKEN = "test-admin-token"


@pytest.fixture(scope="session")
def tiny_model():
    from dlora.models.tiny import ensure_test_model

    return ensure_test_model()


@pytest.fixture(scope="session")
def oracle(tiny_model):
    return HFOracle(tiny_model)


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """One real server shared by the API tests: 1 replica, adapters a0 (pinned), a1, a2; a3 left for
    the admin API. The admin token is on, so the admin tests can check 401s."""
    tmp = tmp_path_factory.mktemp("server")
    server = harness.launch(tmp, harness.tiny_config(tiny_model, tmp / "state", harness.free_port(),
                                                     **{"server.admin_token": ADMIN_TOKEN}))
    yield server
    server.stop()
