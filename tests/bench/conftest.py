from __future__ import annotations

import pytest

from tests.bench.fake_openai import FakeServer


@pytest.fixture(scope="session")
def fake_server():
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture
def fake(fake_server):
    """The shared fake server with its knobs reset for each test."""
    s = fake_server.state
    s.token_delay, s.first_token_delay, s.send_usage, s.adapter_list = 0.002, 0.005, True, None
    s.received.clear()
    return fake_server
