"""Shared fixtures (the tiny test model, the shared dlora servers, the HF + PEFT oracle), the hooks of
`pytest --fast` (tests/fast_lane.py) and of the parallel run (tests/schedule.py)."""

from __future__ import annotations

import os
import sys

import pytest

from tests import fast_lane, harness, schedule
from tests.oracle import HFOracle

ADMIN_TOKEN = "test-admin-token"
# Fixtures that start a server or engine once for the whole run, shared across modules: a test using
# one is marked `engine` (tests/fast_lane.py) and runs in that fixture's group (tests/schedule.py).
ENGINE_FIXTURES = frozenset(
    {"tiny_server", "toy_server", "shipped_server", "einsum_server", "two_replica_server", "merged_switching_engine"}
)
# Run-wide fixtures that start nothing but cost enough that the tests using them share a worker.
COSTLY_FIXTURES = frozenset({"smollm2_cache", "fresh_tiny_root"})
_fast_lane_patches = pytest.MonkeyPatch()


def pytest_addoption(parser):
    parser.addoption(
        "--fast",
        action="store_true",
        help="only the tests that start no vLLM engine, dlora server or Ray cluster (tests/fast_lane.py)",
    )


def pytest_configure(config):
    if config.getoption("fast"):
        fast_lane.refuse_engine_starts(_fast_lane_patches)
    schedule.pin_worker_to_its_core()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(fast_lane.MARKER)
    if config.getoption("fast"):
        fast_lane.select(items, config)
    schedule.group_and_order(items, ENGINE_FIXTURES | COSTLY_FIXTURES)


@pytest.hookimpl(tryfirst=True)  # before the fixtures that use it are set up
def pytest_runtest_setup(item):
    schedule.SHARED.restart_if_needed(item)


@pytest.hookimpl(trylast=True)  # after the fixtures that use it are torn down
def pytest_runtest_teardown(item, nextitem):
    schedule.SHARED.stop_unless_next_uses(item, nextitem)


@pytest.fixture(scope="session")
def tiny_model():
    from dlora.models.tiny import ensure_test_model

    return ensure_test_model()


@pytest.fixture(scope="session")
def oracle(tiny_model):
    return HFOracle(tiny_model)


@pytest.fixture(scope="session")
def shipped_oracle():
    """HF + PEFT in fp32 on the shipped model (tests/oracle.py), shared by the modules that score the
    shipped server's answers; they run in its group, on one worker, so each model loads once."""
    from tests.oracle import ShippedOracle

    return ShippedOracle()


@pytest.fixture(scope="session")
def tiny_server(tiny_model, tmp_path_factory):
    """One real server shared by the API tests: 1 replica, adapters a0 (pinned), a1, a2; a3 left for
    the admin API. The admin token is on, so the admin tests can check 401s; client priorities are
    allowed, so the API tests can send them. Its drain waits up to 120 s: test_drain.py ends it with
    SIGTERM while streams run, which must finish on a busy machine too."""
    tmp = tmp_path_factory.mktemp("server")
    overrides = {
        "server.admin_token": ADMIN_TOKEN,
        "server.allow_client_priority": True,
        "server.drain_timeout_s": 120,
    }
    server = harness.launch(tmp, harness.tiny_config(tiny_model, tmp / "state", harness.free_port(), **overrides))
    yield schedule.SHARED.register("tiny_server", server)
    server.stop(wait=False)


@pytest.fixture(scope="session")
def toy_server(tiny_model, tmp_path_factory):
    """The real app over toy replicas (tests/toy_serve.py), for tests where no engine is the subject:
    the tiny config with its default validation settings (no client priority, no request
    templates) and an API key (harness.TOY_API_KEY). Shared by test_hostile_client.py and test_tokenize.py."""
    tmp = tmp_path_factory.mktemp("toy")
    cfg = harness.tiny_config(tiny_model, tmp / "state", harness.free_port(), **{"server.api_key": harness.TOY_API_KEY})
    server = harness.launch(tmp, cfg, toy=True)
    yield schedule.SHARED.register("toy_server", server)
    server.stop(wait=False)


@pytest.fixture(scope="session")
def shipped_server(tmp_path_factory):
    """configs/default.yaml as shipped, on one replica: shared by the tests that hold the shipped
    model to HF (test_default_config.py, test_sampling_fields.py); one server start instead of two."""
    from tests.oracle import shipped_config

    tmp = tmp_path_factory.mktemp("shipped")
    server = harness.launch(tmp, shipped_config(tmp))
    yield schedule.SHARED.register("shipped_server", server)
    server.stop(wait=False)


@pytest.fixture(scope="session")
def two_replica_server(tiny_model, tmp_path_factory):
    """The tiny server on two replicas (least-loaded dispatch, stats read every 0.5 s), every adapter
    pinned so each is on both replicas from the start (unpinned ones would start on one and spread
    by demand: tests/server/test_host_lora_cache.py); pins need max_loras + 3 host entries. Shared by
    test_two_replicas.py and test_replica_sigkill.py, whose killed replica serves again before it ends."""
    tmp = tmp_path_factory.mktemp("two")
    cfg = harness.tiny_config(
        tiny_model,
        tmp / "state",
        harness.free_port(),
        **{"cluster": {"num_replicas": 2, "dispatch": "least_loaded", "monitor_interval_s": 0.5}},
    )
    cfg["engine"]["max_cpu_loras"] = 5
    for adapter in cfg["adapters"]:
        adapter["pinned"] = True
    server = harness.launch(tmp, cfg)
    yield schedule.SHARED.register("two_replica_server", server)
    server.stop(wait=False)


@pytest.fixture(scope="session")
def hostile_adapter_root(tmp_path_factory):
    """An adapter root of the einsum server, where the hostile-adapter and resolver tests write their
    (broken) copies."""
    return tmp_path_factory.mktemp("adapter-roots")


@pytest.fixture(scope="session")
def s3_adapter_store(tiny_model):
    """An S3-compatible store (moto's server) holding one adapter, `tenants/from-s3` (a copy of a3),
    that exists nowhere on disk: the object-store root of `einsum_server`'s adapter resolver."""
    from tests.s3 import client, s3_server, upload_adapter

    with s3_server() as url:
        store = client(url)
        store.create_bucket(Bucket="adapters")
        upload_adapter(store, "adapters", "tenants/from-s3", tiny_model.adapters["a3"])
        yield url


@pytest.fixture(scope="session")
def einsum_server(tiny_model, hostile_adapter_root, s3_adapter_store, tmp_path_factory):
    """The tiny server with `engine.lora_backend: einsum` (which reads every slot's weights) and
    dlora's policy switching often with mixed merged steps (harness.SWITCH_OFTEN_MIXED), so that
    every answer it gives is also one of a replica that keeps merging and unmerging, and with
    adapters found by name (`server.resolve_adapters`) under its roots (the test model's directory,
    where a3 is left unregistered, and `hostile_adapter_root`) and in `s3_adapter_store`. Shared by
    test_lora_backend.py, test_adapter_safety.py, test_adapter_resolution.py and
    test_batching_modes.py."""
    tmp = tmp_path_factory.mktemp("einsum")
    roots = [str(tiny_model.base.parent), str(hostile_adapter_root)]
    overrides = {
        "engine.lora_backend": "einsum",
        "server.adapter_roots": roots,
        "server.resolve_adapters": True,
        "server.adapter_s3_uri": "s3://adapters/tenants",
        "server.adapter_s3_endpoint_url": s3_adapter_store,
        "scheduling": harness.SWITCH_OFTEN_MIXED,
    }
    cfg = harness.tiny_config(tiny_model, tmp / "state", harness.free_port(), **overrides)
    server = harness.launch(tmp, cfg)
    yield schedule.SHARED.register("einsum_server", server)
    server.stop(wait=False)


_exit_status: int | None = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's own status once its report is written. Why: the in-process vLLM
    engines (tests/engine_ext) leave native OpenMP/oneDNN threads behind, and tearing the interpreter
    down under them can segfault after every test has passed, which would turn a green run red.
    Ray and the test servers are stopped by their fixtures before this point; this waits until the
    servers told to stop have exited."""
    if _exit_status is None:
        return
    harness.wait_for_stopped_servers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
