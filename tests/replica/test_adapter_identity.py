"""An adapter version's identity is its content: the name the engine knows it by carries its digest,
so the same bytes are the same adapter to the engine (and to vLLM's prefix cache, which keys blocks
by that name and the path) and two contents under one name never share a name, a credit or a block."""

from __future__ import annotations

import pytest

from dlora.config import ConfigError
from dlora.config.adapters import AdapterSpec
from dlora.replica.messages import AdapterRef, adapter_of_engine_name

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64


def test_engine_name_is_the_name_and_the_content_digest():
    v1 = AdapterRef("pirate", 1, "/s/pirate-aaaa", version=1, digest=DIGEST_A)
    v2 = AdapterRef("pirate", 2, "/s/pirate-bbbb", version=2, digest=DIGEST_B)
    again = AdapterRef("pirate", 7, "/elsewhere", version=3, digest=DIGEST_A)  # the same bytes, registered again
    assert v1.engine_name == "pirate@" + "a" * 16
    assert v1.engine_name != v2.engine_name
    assert again.engine_name == v1.engine_name
    assert {adapter_of_engine_name(r.engine_name) for r in (v1, v2, again)} == {"pirate"}


def test_a_version_never_snapshotted_is_told_apart_by_its_number():
    assert AdapterRef("a0", 1, "/p").engine_name == "a0"
    assert AdapterRef("a0", 2, "/p", version=2).engine_name == "a0@v2"
    assert adapter_of_engine_name("a0@v2") == "a0" and adapter_of_engine_name("a0") == "a0"


@pytest.mark.parametrize("name", ["pirate@v2", "has space", "", "ünicode"])
def test_config_refuses_an_adapter_name_an_engine_name_could_not_hold(name):
    with pytest.raises(ConfigError, match="adapters: name"):
        AdapterSpec(name=name, path="/a")


@pytest.mark.parametrize("name", ["pirate", "org/team:v1.2", "a_b-c"])
def test_config_takes_the_names_the_load_route_takes(name):
    assert AdapterSpec(name=name, path="/a").name == name
