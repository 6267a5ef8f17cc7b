"""The S3 resolver against a real S3-compatible HTTP server started here: it fetches exactly the
adapter's two objects, refuses what it should not fetch, and tells an unreachable store apart from
a missing adapter."""

from __future__ import annotations

import pytest

from dlora.adapters import resolver_s3
from dlora.adapters.resolver import AdapterSourceError
from dlora.adapters.resolver_s3 import S3Resolver, download_dir_name, parse_s3_uri
from dlora.adapters.validate import AdapterValidationError
from tests import harness
from tests.s3 import client, s3_server, upload_adapter

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def endpoint():
    with s3_server() as url:
        s3 = client(url)
        s3.create_bucket(Bucket="adapters")
        yield url


@pytest.fixture
def s3(endpoint):
    return client(endpoint)


def test_uris_split_into_bucket_and_prefix():
    assert parse_s3_uri("s3://b") == ("b", "")
    assert parse_s3_uri("s3://b/tenants/") == ("b", "tenants")
    for bad in ("b/prefix", "s3://", "s3:///prefix", "https://b"):
        with pytest.raises(ValueError):
            parse_s3_uri(bad)


def test_an_adapter_is_downloaded_with_exactly_its_two_files(endpoint, s3, tiny_model, tmp_path):
    upload_adapter(s3, "adapters", "tenants/team/summariser", tiny_model.adapters["a3"])
    s3.put_object(Bucket="adapters", Key="tenants/team/summariser/notes.bin", Body=b"never fetched")
    resolver = S3Resolver("s3://adapters/tenants", endpoint, tmp_path / "resolved")
    path = resolver.resolve("team/summariser")
    assert path == str(tmp_path / "resolved" / download_dir_name("team/summariser"))
    got = sorted(p.name for p in (tmp_path / "resolved").iterdir())
    assert got == [download_dir_name("team/summariser")]  # no staging directory left behind
    for f in FILES:
        assert (tmp_path / "resolved" / got[0] / f).read_bytes() == (tiny_model.adapters["a3"] / f).read_bytes()
    assert sorted(p.name for p in (tmp_path / "resolved" / got[0]).iterdir()) == sorted(FILES)


def test_a_new_upload_replaces_the_earlier_download(endpoint, s3, tiny_model, tmp_path):
    resolver = S3Resolver("s3://adapters", endpoint, tmp_path)
    upload_adapter(s3, "adapters", "swap", tiny_model.adapters["a1"])
    first = resolver.resolve("swap")
    upload_adapter(s3, "adapters", "swap", tiny_model.adapters["a2"])
    assert resolver.resolve("swap") == first
    weights = (tiny_model.adapters["a2"] / FILES[1]).read_bytes()
    assert (tmp_path / download_dir_name("swap") / FILES[1]).read_bytes() == weights


def test_missing_adapters_and_unsafe_names_are_not_found(endpoint, s3, tiny_model, tmp_path):
    s3.upload_file(str(tiny_model.adapters["a3"] / FILES[0]), "adapters", "config-only/adapter_config.json")
    resolver = S3Resolver("s3://adapters", endpoint, tmp_path)
    assert resolver.resolve("nobody") is None
    assert resolver.resolve("config-only") is None  # no weights: not an adapter
    assert resolver.resolve("../config-only") is None
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_an_oversized_object_is_refused_before_it_is_fetched(endpoint, s3, tiny_model, tmp_path, monkeypatch):
    upload_adapter(s3, "adapters", "big", tiny_model.adapters["a3"])
    monkeypatch.setattr(resolver_s3, "MAX_OBJECT_BYTES", 100)
    with pytest.raises(AdapterValidationError, match="more than 100"):
        S3Resolver("s3://adapters", endpoint, tmp_path).resolve("big")
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_an_unreachable_store_is_a_source_error_not_a_missing_adapter(endpoint, tmp_path):
    closed = f"http://127.0.0.1:{harness.free_port()}"
    with pytest.raises(AdapterSourceError):
        S3Resolver("s3://adapters", closed, tmp_path).resolve("anything")
    with pytest.raises(AdapterSourceError):
        S3Resolver("s3://no-such-bucket", endpoint, tmp_path).resolve("anything")
