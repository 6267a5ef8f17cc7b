"""Nothing of an unloaded adapter touches a later step.

vLLM's unload leaves a slot's LoRA weights in place, and the einsum backend multiplies every token
by every packed slot before masking, so 0 * NaN would turn every request of a replica into NaN.
The einsum wrapper packs only occupied slots (unit test, no engine), and an unload zeroes the free
slots inside the engine (tiny model, einsum backend)."""

from __future__ import annotations

import pytest
import torch

from dlora.engine_ext.packed_stacks import pack
from dlora.engine_ext.punica_wrapper import PunicaWrapperEinsum
from dlora.replica.messages import AdapterRef, GenerateRequest, SamplingSpec
from tests.replica.test_engine_host import running_host

SLOTS, R, H_IN, H_OUT = 3, 4, 16, 8


def poisoned_stacks():
    """Slots 0 and 2 hold adapters; slot 1 still holds a removed adapter's NaN weights."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, 1, R, H_IN, generator=g)
    b = torch.randn(SLOTS, 1, H_OUT, R, generator=g)
    a[1], b[1] = 1.0, float("nan")
    return a, b


def test_a_free_slot_is_never_packed():
    a, b = poisoned_stacks()
    packed = pack(a, b, live=(True, False, True))
    assert packed.ranks == (R, 0, R)
    assert torch.isfinite(packed.a).all() and torch.isfinite(packed.b).all()
    assert pack(a, b).ranks == (R, R, R)  # without the occupancy every slot counts


def test_tokens_stay_finite_and_exact_beside_a_free_poisoned_slot():
    from vllm.lora.layers import LoRAMapping

    a, b = poisoned_stacks()
    ids = [11, None, 13]  # vLLM's lora_index_to_id after slot 1's adapter was removed
    mapping = (11, 0, 13, 13, 0, 11)
    w = PunicaWrapperEinsum(64, 8, "cpu")
    w.update_metadata(LoRAMapping(mapping, mapping, is_prefill=False), ids, SLOTS, 100)
    g = torch.Generator().manual_seed(1)
    x, y0 = torch.randn(len(mapping), H_IN, generator=g), torch.randn(len(mapping), H_OUT, generator=g)
    y = y0.clone()
    w.add_lora_linear(y, x, (a,), (b,), 0.5, (H_OUT,))
    assert torch.isfinite(y).all()
    want = y0.double().clone()
    for t, lora_id in enumerate(mapping):
        if lora_id:
            n = ids.index(lora_id)
            want[t] += 0.5 * (b[n, 0].double() @ (a[n, 0].double() @ x[t].double()))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def greedy(request_id: str, adapter: AdapterRef | None) -> GenerateRequest:
    return GenerateRequest(
        request_id, tuple(range(5, 30)), SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True), adapter
    )


async def tokens(h, req: GenerateRequest) -> list[int]:
    return [t async for d in h.generate(req) for t in d.token_ids]


@pytest.mark.engine
def test_unloading_zeroes_the_adapters_slot_inside_the_engine(tiny_model):
    ref = AdapterRef("a1", 1, str(tiny_model.adapters["a1"]))
    with running_host(tiny_model, lora_backend="einsum", max_loras=2, max_cpu_loras=4, max_lora_rank=8) as (h, loop):

        def slots():
            (per_worker,) = loop.run_until_complete(h.engine.collective_rpc("dlora_lora_slots"))
            return per_worker

        base_before = loop.run_until_complete(tokens(h, greedy("b0", None)))
        loop.run_until_complete(h.add_adapter(ref))
        with_adapter = loop.run_until_complete(tokens(h, greedy("x0", ref)))
        held = [s for s in slots() if s["lora_id"] == 1]
        assert len(held) == 1 and held[0]["max_abs"] > 0  # the adapter was activated into a slot

        assert loop.run_until_complete(h.remove_adapter(1)) is True
        after = slots()
        assert all(s["lora_id"] is None for s in after)
        assert after[held[0]["slot"]]["max_abs"] == 0.0  # vLLM alone leaves the weights there
        assert loop.run_until_complete(h.resident_adapter_ids()) == []
        assert loop.run_until_complete(tokens(h, greedy("b1", None))) == base_before
        # Loading it again activates it afresh: the same tokens as before the unload.
        loop.run_until_complete(h.add_adapter(ref))
        assert loop.run_until_complete(tokens(h, greedy("x1", ref))) == with_adapter
