"""How the parallel run groups and orders tests (tests/schedule.py), on stand-in items."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests import schedule


@dataclass
class Item:
    nodeid: str
    fixturenames: tuple[str, ...] = ()
    marks: list = field(default_factory=list)

    def get_closest_marker(self, name):
        return next((m for m in reversed(self.marks) if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark if hasattr(mark, "mark") else mark)


def engine(nodeid, *fixtures, group=None):
    marks = [pytest.mark.engine.mark] + ([pytest.mark.xdist_group(group).mark] if group else [])
    return Item(nodeid, fixtures, marks)


SHARED = frozenset({"tiny_server", "shipped_server"})


def test_groups_and_order():
    items = [
        Item("tests/a/test_unit.py::test_1"),
        engine("tests/s/test_logprobs.py::test_own[x]", "oracle", group="shipped_server"),
        engine("tests/s/test_logprobs.py::test_shared", "shipped_server"),
        Item(
            "tests/s/test_drain.py::test_sigterm",
            ("tiny_server",),
            [pytest.mark.engine.mark, pytest.mark.ends_shared_server.mark],
        ),
        engine("tests/s/test_api.py::test_1", "tiny_server"),
        engine("tests/s/test_own.py::test_1"),
        Item("tests/a/test_unit.py::test_2"),
        engine("tests/s/test_api.py::test_2", "tiny_server"),
        engine("tests/s/test_big.py::test_1"),
        engine("tests/s/test_big.py::test_2"),
    ]
    schedule.group_and_order(items, SHARED)
    order = [i.nodeid for i in items]
    assert order == [
        # shared groups first, largest first (tiny 3, shipped 2); inside a group its server's users
        # come first, the one that ends the server last of them, then the module's own servers
        "tests/s/test_api.py::test_1",
        "tests/s/test_api.py::test_2",
        "tests/s/test_drain.py::test_sigterm",
        "tests/s/test_logprobs.py::test_shared",
        "tests/s/test_logprobs.py::test_own[x]",
        # then the other engine groups, largest first
        "tests/s/test_big.py::test_1",
        "tests/s/test_big.py::test_2",
        "tests/s/test_own.py::test_1",
        # then the rest, module by module in collection order
        "tests/a/test_unit.py::test_1",
        "tests/a/test_unit.py::test_2",
    ]
    groups = {i.nodeid: i.get_closest_marker("xdist_group").args[0] for i in items}
    assert groups["tests/s/test_api.py::test_2"] == "tiny_server"
    assert groups["tests/s/test_logprobs.py::test_own[x]"] == "shipped_server"  # its own mark
    assert groups["tests/s/test_big.py::test_2"] == "tests/s/test_big.py"
    assert groups["tests/a/test_unit.py::test_1"] == "tests/a/test_unit.py"


@dataclass
class Server:
    running: bool = True
    starts: int = 0
    stops: int = 0

    def start(self):
        self.running, self.starts = True, self.starts + 1

    waited: bool | None = None

    def stop(self, wait: bool = True):
        self.running, self.stops, self.waited = False, self.stops + 1, wait


def test_a_shared_server_stops_after_its_last_user_and_starts_again_for_a_later_one():
    shared, server = schedule.SharedServers(), Server()
    shared.register("tiny_server", server)
    user, other = Item("a", ("tiny_server",)), Item("b")
    shared.stop_unless_next_uses(user, Item("c", ("tiny_server",)))
    assert server.running and server.stops == 0  # the next test uses it
    shared.stop_unless_next_uses(user, other)
    assert not server.running and server.stops == 1
    assert server.waited is False  # it shuts down while the next test runs
    shared.restart_if_needed(other)
    assert not server.running  # a test that does not use it does not start it
    shared.restart_if_needed(user)
    assert server.running and server.starts == 1
    shared.stop_unless_next_uses(user, None)  # the last test of the run
    assert not server.running
