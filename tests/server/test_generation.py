"""From vLLM's engine requests to the replicas' (no engine): one routed leg per sample, what each
carries, prompts the engines can take, and logprobs JSON can carry."""

from __future__ import annotations

import json
import math

import pytest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from dlora.replica.messages import SamplingSpec, TokenLogprob
from dlora.server.engine_client import LOGPROB_FLOOR, check_prompt, legs, spec_of, vllm_logprobs

VOCAB = 100


def test_every_leg_carries_the_priority_and_seed_plus_its_index():
    out = legs("cmpl-1-0", [1, 2, 3], SamplingSpec(max_tokens=4, seed=10), 3, None, -7)
    assert [j.request.request_id for j in out] == ["0_cmpl-1-0", "1_cmpl-1-0", "2_cmpl-1-0"]
    assert [j.index for j in out] == [0, 1, 2]
    assert [j.request.priority for j in out] == [-7] * 3
    assert [j.request.sampling.seed for j in out] == [10, 11, 12]
    one = legs("cmpl-2-0", [1], SamplingSpec(max_tokens=4), 1, None, 0)
    assert [j.request.request_id for j in one] == ["cmpl-2-0"] and one[0].request.sampling.seed is None


def test_no_arrival_stamp_before_the_router():
    """The router stamps a request's first arrival; a leg carries none of its own."""
    assert all(j.request.arrival_time is None for j in legs("r", [1], SamplingSpec(max_tokens=2), 3, None, 0))


@pytest.mark.parametrize("ids", [[], [1, 2, VOCAB], [-1, 2]])
def test_empty_or_out_of_vocabulary_prompts_are_refused_naming_the_prompt(ids):
    with pytest.raises(VLLMValidationError) as e:
        check_prompt(ids, VOCAB)
    assert e.value.parameter == "prompt"
    check_prompt([0, VOCAB - 1], VOCAB)


def test_the_last_legs_seed_must_fit_int64():
    with pytest.raises(VLLMValidationError) as e:
        spec_of(SamplingParams(max_tokens=4, seed=2**63 - 1, n=2), VOCAB)
    assert e.value.parameter == "seed"
    assert spec_of(SamplingParams(max_tokens=4, seed=2**63 - 2, n=2), VOCAB).seed == 2**63 - 2


def test_a_field_replicas_cannot_carry_is_refused_naming_it():
    with pytest.raises(VLLMValidationError) as e:
        spec_of(SamplingParams(max_tokens=4, logprob_token_ids=[1, 2]), VOCAB)
    assert e.value.parameter == "logprob_token_ids"


@pytest.mark.parametrize(
    "constraint",
    [
        {"choice": ["yes", "no"]},
        {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}, "disable_any_whitespace": True},
        {"regex": "[a-c]+"},
        {"grammar": 'root ::= "x" | "y"'},
        {"json_object": True},
    ],
)
def test_structured_outputs_reach_the_replica_as_vllm_built_them(constraint):
    from vllm.sampling_params import StructuredOutputsParams

    from dlora.replica.engine import to_sampling_params

    built = StructuredOutputsParams(**constraint)
    built._backend = "xgrammar"  # what vLLM's check in the API process sets; each engine picks its own
    spec = spec_of(SamplingParams(max_tokens=4, structured_outputs=built), VOCAB)
    assert json.loads(spec.structured_outputs) == constraint
    on_replica = to_sampling_params(spec).structured_outputs
    assert on_replica == StructuredOutputsParams(**constraint) and on_replica._backend is None
    assert spec_of(SamplingParams(max_tokens=4), VOCAB).structured_outputs is None


def test_a_continuation_tells_its_engine_how_many_prompt_tokens_it_generated_before():
    from dlora.replica.engine import GENERATED_BEFORE_KEY, to_sampling_params

    structured = SamplingSpec(max_tokens=4, structured_outputs='{"regex": "a+"}', generated_before=3)
    assert to_sampling_params(structured).extra_args == {GENERATED_BEFORE_KEY: 3}
    assert to_sampling_params(SamplingSpec(max_tokens=4, generated_before=3)).extra_args == {GENERATED_BEFORE_KEY: 3}
    assert to_sampling_params(SamplingSpec(max_tokens=4, structured_outputs='{"regex": "a+"}')).extra_args is None


def test_logit_bias_allowed_ids_and_bad_words_reach_the_replicas_spec():
    params = SamplingParams(
        max_tokens=4, logit_bias={7: -2.5, 3: 1.0}, allowed_token_ids=[3, 7], bad_words=["no"], prompt_logprobs=2
    )
    spec = spec_of(params, VOCAB)
    assert spec.prompt_logprobs == 2
    assert dict(spec.logit_bias) == {7: -2.5, 3: 1.0}
    assert spec.allowed_token_ids == (3, 7) and spec.bad_words == ("no",)
    plain = spec_of(SamplingParams(max_tokens=4), VOCAB)
    assert (plain.logit_bias, plain.allowed_token_ids, plain.bad_words, plain.prompt_logprobs) == ((), None, (), None)


def test_non_finite_logprobs_are_floored_as_vllm_does():
    lps = [TokenLogprob(1, -math.inf, "a", ((2, math.nan, "b"), (3, -0.5, "c"))), TokenLogprob(4, -1.0, "d")]
    out = vllm_logprobs(lps)
    assert [{t: (lp.logprob, lp.rank) for t, lp in step.items()} for step in out] == [
        {1: (LOGPROB_FLOOR, None), 2: (LOGPROB_FLOOR, 1), 3: (-0.5, 2)},
        {4: (-1.0, None)},
    ]
    json.dumps([[lp.logprob for lp in step.values()] for step in out], allow_nan=False)


def test_each_tokens_rank_is_vllms_whether_or_not_it_is_among_the_top():
    lps = [
        TokenLogprob(9, -4.0, "z", ((2, -0.1, "b"), (3, -0.5, "c")), rank=17),
        TokenLogprob(3, -0.5, "c", ((2, -0.1, "b"), (3, -0.5, "c"))),
    ]
    out = vllm_logprobs(lps)
    assert [{t: lp.rank for t, lp in step.items()} for step in out] == [{9: 17, 2: 1, 3: 2}, {3: 2, 2: 1}]


def test_the_first_legs_cached_prompt_tokens_reach_vllms_output():
    """vLLM's serving classes read `num_cached_tokens` and `num_cache_creation_tokens` for
    usage.prompt_tokens_details: the counts the first leg's replica reported with its first delta,
    not a later leg's (whose prompt holds generated tokens too)."""
    from vllm.sampling_params import RequestOutputKind

    from dlora.replica.messages import Delta
    from dlora.server.engine_client import LegOutput, RequestOutputs

    out = RequestOutputs("cmpl-1", None, [1, 2, 3], RequestOutputKind.DELTA, None, [LegOutput(0)])
    out.add(0, Delta(token_ids=[5], text="a", cached_tokens=256, cache_creation_tokens=128))
    out.add(0, Delta(token_ids=[6], text="b"))
    out.add(0, Delta(token_ids=[7], text="c", cached_tokens=300, cache_creation_tokens=0))  # a moved leg's first
    first = out.after(0)
    assert first is not None and (first.num_cached_tokens, first.num_cache_creation_tokens) == (256, 128)
