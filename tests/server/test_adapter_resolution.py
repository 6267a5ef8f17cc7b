"""Adapters found by name, without an admin call (`server.resolve_adapters`), on a real server: a
request naming an unregistered adapter under the roots, or in an S3-compatible store (moto's
server, started by the suite), is served with its own weights (checked against Hugging Face + PEFT);
concurrent first requests register it once; unknown and unsafe names are 404s; found-but-bad files
are a 400 that reveals no path, and hurt nobody. The server is the shared `einsum_server`
(tests/conftest.py), whose adapter roots and object store these tests use."""

from __future__ import annotations

import concurrent.futures
import re
import shutil
import time

import httpx
import pytest

from dlora.adapters.on_demand import MISSING_RETRY_S
from tests.server.test_adapter_safety import _nan_tensor, _symlink_escape
from tests.server.test_admin_api import complete

pytestmark = pytest.mark.engine  # a `dlora serve` process


@pytest.fixture
def root(hostile_adapter_root):
    """An adapter root of the server, where these tests place adapters for it to find."""
    return hostile_adapter_root


@pytest.fixture
def server(einsum_server):
    return einsum_server


def resolved(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^dlora_adapters_resolved_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def listed(url: str) -> dict[str, dict]:
    return {a["name"]: a for a in httpx.get(f"{url}/v1/adapters", timeout=30).json()["data"]}


def test_an_unregistered_adapter_under_the_roots_is_served_with_its_own_weights(server, oracle):
    assert "a3" not in listed(server.url)
    r = complete(server.url, "a3")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == oracle.greedy("a3", choice["prompt_token_ids"], 6)
    assert listed(server.url)["a3"]["source"] == "resolver"
    assert "a3" in {m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]}


def test_concurrent_first_requests_register_the_adapter_once(server, tiny_model, root, oracle):
    shutil.copytree(tiny_model.adapters["a3"], root / "team" / "summariser")
    before = resolved(server.url, "registered")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: complete(server.url, "team/summariser"), range(8)))
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    for r in responses:
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == oracle.greedy("a3", choice["prompt_token_ids"], 6)
    assert resolved(server.url, "registered") == before + 1  # counted when it happened, not on scrape
    assert listed(server.url)["team/summariser"]["source"] == "resolver"


@pytest.mark.parametrize(
    "name", ["nobody", "../a3", "a3/..", "/etc", "team//summariser", "a/b/c/d/e", ".hidden", "base"]
)
def test_unknown_or_unsafe_names_are_404(server, name):
    r = complete(server.url, name)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "model"


def test_bad_files_found_by_name_are_a_400_that_reveals_no_path_and_harm_nobody(server, tiny_model, root):
    bad, outside = root / "broken", root.parent / "resolver-outside"
    shutil.copytree(tiny_model.adapters["a3"], bad)
    _nan_tensor(bad)
    escaping = root / "escaping"
    shutil.copytree(tiny_model.adapters["a3"], escaping)
    _symlink_escape(escaping, outside)
    before = resolved(server.url, "refused")
    for name in ("broken", "escaping"):
        r = complete(server.url, name)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and name in err["message"]
        assert str(root) not in r.text and "/" not in err["message"]
        # Asked again at once: refused from memory, the bad files are not copied and hashed again.
        assert complete(server.url, name).status_code == 400
    assert resolved(server.url, "refused") == before + 2
    assert "broken" not in listed(server.url) and "escaping" not in listed(server.url)
    assert complete(server.url, "a1").status_code == 200
    assert complete(server.url, "tiny-base").status_code == 200


def test_an_adapter_only_in_the_object_store_is_fetched_and_served(server, oracle):
    r = complete(server.url, "from-s3")
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == oracle.greedy("a3", choice["prompt_token_ids"], 6)
    assert listed(server.url)["from-s3"]["source"] == "resolver"


def test_a_missing_name_is_remembered_briefly_then_looked_up_again(server, tiny_model, root):
    assert complete(server.url, "late").status_code == 404
    shutil.copytree(tiny_model.adapters["a3"], root / "late")
    before = resolved(server.url, "not_found")
    assert complete(server.url, "late").status_code == 404  # answered from memory: no new lookup
    assert resolved(server.url, "not_found") == before
    time.sleep(MISSING_RETRY_S)
    assert complete(server.url, "late").status_code == 200
