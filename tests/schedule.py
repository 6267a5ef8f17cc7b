"""How the suite runs in parallel (`pytest -n 2 --dist loadgroup --no-loadscope-reorder`, `make test`)
and keeps few servers up at once.

- **Groups.** Every test gets an `xdist_group`: the shared server or costly fixture it uses
  (`tiny_server`, ...), else its module, so a module's own servers and fixtures are set up once, on
  one worker. A
  module may name a group itself (`pytestmark = pytest.mark.xdist_group("shipped_server")`) to share
  a worker, and so never run at the same time, with another group's servers.
- **Order.** A group's tests run one after another on one worker, the groups that start servers
  first (the longest work first leaves the short tests to fill in at the end), and inside a group
  the users of its shared server first, so the server can stop before the group's other servers
  start; of those, a test that ends the server itself (`ends_shared_server`) last.
- **Stopping after the last user.** A shared server stops once the next test on its worker does not
  use it (`SharedServers`); a later test that does use it starts it again on the same config.
- **Cores.** Each worker is pinned to a core of its own, so the servers it starts pin their replicas
  there and two workers' one-replica servers do not share core 0.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import ServerProcess

GROUP_MARK = "xdist_group"
ENDS_SHARED = "ends_shared_server"  # the test stops its shared server: it goes after the other users


class SharedServers:
    """The run-wide servers and in-process engines of this process, by fixture name: anything
    with `running`, `start()` and `stop()` (harness.ServerProcess, engine_ext/inprocess.SharedEngine)."""

    def __init__(self) -> None:
        self._servers: dict[str, ServerProcess] = {}

    def register(self, name: str, server: ServerProcess) -> ServerProcess:
        self._servers[name] = server
        return server

    def restart_if_needed(self, item: pytest.Item) -> None:
        for name, server in self._servers.items():
            if name in _fixtures(item) and not server.running:
                server.start()

    def stop_unless_next_uses(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        for name, server in self._servers.items():
            if name in _fixtures(item) and (nextitem is None or name not in _fixtures(nextitem)):
                server.stop(wait=False)


SHARED = SharedServers()


def group_of(item: pytest.Item, shared: frozenset[str]) -> str:
    """The xdist group a test runs in: its own mark's, else the shared fixture it uses, else its
    module's (so that module-scoped fixtures are set up once, on one worker)."""
    mark = item.get_closest_marker(GROUP_MARK)
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    used = sorted(shared.intersection(_fixtures(item)))
    return used[0] if used else item.nodeid.split("::")[0]


def group_and_order(items: list[pytest.Item], shared: frozenset[str]) -> None:
    """Mark each test with its group and reorder `items` in place: the groups that start engines
    first (those holding a shared fixture, then the others by size, largest first), then the rest in
    collection order; a group's tests contiguous, its shared fixture's users first."""
    groups = {id(item): group_of(item, shared) for item in items}
    sizes: dict[str, int] = {}
    engine: set[str] = set()
    first_seen: dict[str, int] = {}
    for position, item in enumerate(items):
        group = groups[id(item)]
        sizes[group] = sizes.get(group, 0) + 1
        first_seen.setdefault(group, position)
        if item.get_closest_marker("engine") is not None:
            engine.add(group)
        if item.get_closest_marker(GROUP_MARK) is None:
            item.add_marker(pytest.mark.xdist_group(group))

    def key(indexed: tuple[int, pytest.Item]) -> tuple:
        position, item = indexed
        group = groups[id(item)]
        holds_shared = group in shared
        after_the_shared_users = holds_shared and group not in _fixtures(item)
        ends_it = item.get_closest_marker(ENDS_SHARED) is not None
        if group not in engine:
            return (2, 0, first_seen[group], after_the_shared_users, ends_it, position)
        return (0 if holds_shared else 1, -sizes[group], first_seen[group], after_the_shared_users, ends_it, position)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def pin_worker_to_its_core() -> None:
    """Pin an xdist worker (gw0, gw1, ...) to one core of this process's set; nothing outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))
