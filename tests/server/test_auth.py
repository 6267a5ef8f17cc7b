"""Who may call what, on the real app and its middleware over toy replicas (no engine, no server
process): with `server.api_key` set every /v1 path needs it, as vLLM's --api-key has it; the admin
routes need `server.admin_token` when one is set, else the API key; /v1/files and /v1/batches take
the admin token besides the keys (tests/batch/test_owners.py); a request without its credential
is a 401 in OpenAI's shape before its body is looked at; /health, /metrics, /version and /tokenize
stay open. At start, one warning when nothing guards the admin routes on a non-loopback address.
The same rules against a running server: test_hostile_client.py."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
from starlette.testclient import TestClient

from dlora.app.asgi import create_app
from dlora.app.state import build_state
from dlora.config import from_dict
from dlora.server import auth, owners
from dlora.sim.toy_replica import ToyReplica
from tests import harness
from tests.asgi_app import app_over

KEY, ADMIN, WRONG = "sk-tenant", "admin-secret", "sk-guess"
JSON = {"content-type": "application/json"}
MALFORMED = b'{"model": '  # a body no route could parse: without the credential it is never read

# (method, path, body) of every kind of route: inference, vLLM's other /v1 routes, a path no route
# has; files and batches; then the admin routes, then the open ones.
INFERENCE = [
    ("POST", "/v1/completions", MALFORMED),
    ("POST", "/v1/chat/completions", MALFORMED),
    ("POST", "/v1/responses", MALFORMED),
    ("GET", "/v1/models", None),
    ("GET", "/v1/responses/resp_1", None),
    ("GET", "/v1/no-such-route", None),
    ("GET", "/v1/filesystem", None),  # only /v1/files and what is under it are files
]
OWNED = [
    ("GET", "/v1/files", None),
    ("GET", "/v1/files/file-1/content", None),
    ("DELETE", "/v1/files/file-1", None),
    ("POST", "/v1/batches", MALFORMED),
    ("GET", "/v1/batches", None),
    ("DELETE", "/v1/batches/batch_1", None),
]
ADMIN_ROUTES = [
    ("GET", "/v1/adapters", None),
    ("GET", "/v1/replicas", None),
    ("POST", "/v1/load_lora_adapter", MALFORMED),
    ("POST", "/v1/unload_lora_adapter", b'{"lora_name": "nobody"}'),
    ("POST", "/v1/replicas/0/drain", None),
]
OPEN = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None)]
OPEN += [("POST", "/tokenize", b'{"model": "tiny-base", "prompt": "hi"}')]

CONFIGS = {
    "api_key": {"server.api_key": KEY},
    "api_key_and_admin_token": {"server.api_key": KEY, "server.admin_token": ADMIN},
    "admin_token": {"server.admin_token": ADMIN},
    "open": {},
}


def config(tiny_model, state_dir, **overrides):
    return from_dict(harness.tiny_config(tiny_model, state_dir, 0, **overrides))


@contextlib.asynccontextmanager
async def app_over_toys(cfg):
    async with app_over(cfg, [ToyReplica(0, step_s=0.001)]) as (http, _):
        yield http


def accepted(overrides: dict, kind: str) -> set[str] | None:
    """The credentials a route of a kind (inference, owned, admin) takes under a config; None: it is open."""
    key, token = overrides.get("server.api_key"), overrides.get("server.admin_token")
    if key is None and (kind != "admin" or token is None):
        return None
    if kind == "admin":
        return {token or key}
    return {key} | ({token} if kind == "owned" and token else set())


@pytest.mark.parametrize("name", CONFIGS)
def test_every_v1_route_needs_its_credential_before_its_body_is_read(tiny_model, tmp_path, name):
    overrides = CONFIGS[name]

    async def run():
        async with app_over_toys(config(tiny_model, tmp_path / "state", **overrides)) as http:
            for routes, kind in ((INFERENCE, "inference"), (OWNED, "owned"), (ADMIN_ROUTES, "admin"), (OPEN, None)):
                taken = None if kind is None else accepted(overrides, kind)
                for method, path, body in routes:
                    for credential in (None, WRONG, KEY, ADMIN):
                        headers = JSON | ({} if credential is None else {"Authorization": f"Bearer {credential}"})
                        r = await http.request(method, path, content=body, headers=headers)
                        refused = taken is not None and credential not in taken
                        assert (r.status_code == 401) == refused, (name, method, path, credential, r.text)
                        if refused:
                            err = r.json()["error"]
                            assert err["type"] == "AuthenticationError" and err["code"] == 401, err
                            admin_message = kind == "admin" and "server.admin_token" in overrides
                            assert err["message"] == (auth.ADMIN_UNAUTHORIZED if admin_message else "Unauthorized")

    asyncio.run(run())


@pytest.mark.parametrize(
    "host, overrides, warned",
    [
        ("0.0.0.0", {}, True),
        ("::", {}, True),
        ("dlora.internal", {}, True),
        ("0.0.0.0", {"server.api_key": KEY}, False),
        ("0.0.0.0", {"server.admin_token": ADMIN}, False),
        ("127.0.0.1", {}, False),
        ("127.0.0.2", {}, False),
        ("::1", {}, False),
        ("localhost", {}, False),
    ],
)
def test_open_admin_routes_are_worth_a_warning_only_off_loopback(tiny_model, tmp_path, host, overrides, warned):
    cfg = config(tiny_model, tmp_path, **{"server.host": host, **overrides})
    warning = auth.admin_exposure(cfg)
    assert (warning is not None) == warned
    if warned:
        assert host in warning and "server.admin_token" in warning


def test_the_start_logs_the_open_admin_routes_once(tiny_model, tmp_path, caplog):
    """Through the app's own lifespan (what uvicorn runs), and a request or two after it: one warning."""
    cfg = config(tiny_model, tmp_path / "state", **{"server.host": "0.0.0.0"})

    async def make_state():
        return await build_state(cfg, replicas=[ToyReplica(0, step_s=0.001)])

    with caplog.at_level(logging.WARNING, logger=auth.__name__):
        with TestClient(create_app(make_state)) as client:
            assert client.get("/v1/adapters").status_code == 200  # open, as the warning says
            assert client.get("/health").status_code == 200
    warnings = [r for r in caplog.records if r.name == auth.__name__]
    assert len(warnings) == 1 and "admin routes" in warnings[0].getMessage(), caplog.text


def test_each_key_is_an_owner_of_its_own_named_by_a_digest_and_the_admin_token_is_every_owner():
    keys = (KEY, "sk-other")
    a, b = owners.owner_of(f"Bearer {KEY}", keys, ADMIN), owners.owner_of("Bearer sk-other", keys, ADMIN)
    assert a == owners.owner_id(KEY) != b == owners.owner_id("sk-other")
    assert a.startswith("key-") and KEY not in a and len(a) == len("key-") + owners.OWNER_HEX_DIGITS
    assert owners.owner_of(f"Bearer {ADMIN}", keys, ADMIN) is None
    for refused in (f"Bearer {WRONG}", "", f"Basic {KEY}", f"Bearer {ADMIN}x"):
        with pytest.raises(auth.Unauthorized):
            owners.owner_of(refused, keys, ADMIN)
    with pytest.raises(auth.Unauthorized):
        owners.owner_of(f"Bearer {ADMIN}", keys, None)  # no admin token configured: not a credential
    # no API key: every caller is the one owner "", the admin token still every owner
    assert owners.owner_of("", (), ADMIN) == owners.owner_of(f"Bearer {WRONG}", (), None) == ""
    assert owners.owner_of(f"Bearer {ADMIN}", (), ADMIN) is None
