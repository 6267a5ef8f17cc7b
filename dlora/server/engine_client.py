"""vLLM's `EngineClient` over dlora's router: what vLLM's own OpenAI serving classes call to generate.

vLLM's frontend (request parsing, defaults, chat templates, response and stream formatting) talks to
its engine only through `EngineClient.generate`; `RouterEngineClient` answers it with the cluster
instead of a local engine core, doing for each request what vLLM's `AsyncLLM` does:

- `n > 1` runs as n requests of its own, each routed (placed, migrated, resubmitted) on its own, with
  seeds `seed + i` (vLLM's `ParentRequest`), and each output carries its `index`;
- outputs come in the request's `output_kind`: DELTA (what is new; `finished` once every leg is),
  FINAL_ONLY (one output holding every leg's whole completion, by index) or CUMULATIVE;
- every output carries the request's prompt ids (vLLM counts prompt usage once per request from them).

Values are checked by vLLM's own `SamplingParams.verify` against the model (structured outputs'
schemas and grammars included), then by dlora's rules for what the engines carry. Prompt logprobs
come from a request's first leg. What a replica cannot carry yet is refused with vLLM's own
validation error naming the field, which vLLM's server answers as a 400: never silently ignored.
dlora's own refusals (an adapter that cannot be served) become the vLLM error of the same status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from vllm.config import VllmConfig
from vllm.engine.protocol import EngineClient
from vllm.exceptions import GracefulHTTPError, VLLMError, VLLMNotFoundError, VLLMValidationError
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.inputs.preprocess import extract_prompt_components
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from vllm.v1.engine.input_processor import InputProcessor

from dlora.adapters.lifecycle import ref_of
from dlora.replica.messages import AdapterRef, Delta, GenerateRequest, SamplingSpec, TokenLogprob
from dlora.server.errors import APIError, as_api_error
from dlora.server.generation import STOP, ChoiceJob, lookup_adapter, run_jobs
from dlora.server.state import ServerState
from dlora.server.validation import check_sampling, check_seed

# SamplingParams fields a replica does not receive yet: their values when unset.
NOT_CARRIED: dict[str, Any] = {
    "logprob_token_ids": None,
    "thinking_token_budget": None,
    "repetition_detection": None,
}


def vllm_error(e: APIError) -> VLLMError:
    """dlora's refusal as the vLLM error its server answers with the same status."""
    if e.status == 404:
        return VLLMNotFoundError(e.message)
    if e.status == 400:
        return VLLMValidationError(e.message, parameter=e.param)
    return GracefulHTTPError(e.message, HTTPStatus(e.status))


def spec_of(params: SamplingParams, vocab_size: int) -> SamplingSpec:
    """What a replica runs for `params` (one leg: n is the client's), or vLLM's validation error
    naming a field it cannot carry or a value it refuses."""
    for name, unset in NOT_CARRIED.items():
        if getattr(params, name, unset) not in (unset, [], {}):
            raise VLLMValidationError(f"`{name}` is not supported by this server yet", parameter=name)
    if params.max_tokens is None:
        raise VLLMValidationError("`max_tokens` must be set", parameter="max_tokens")
    stop = params.stop
    spec = SamplingSpec(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed,
        stop=tuple([stop] if isinstance(stop, str) else stop or ()),
        stop_token_ids=tuple(params.stop_token_ids or ()),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens=params.skip_special_tokens,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=tuple((int(t), float(b)) for t, b in (params.logit_bias or {}).items()),
        allowed_token_ids=None if params.allowed_token_ids is None else tuple(params.allowed_token_ids),
        bad_words=tuple(params.bad_words or ()),
        structured_outputs=structured_json(params.structured_outputs),
    )
    try:
        check_sampling(spec, vocab_size)
        if spec.seed is not None:
            check_seed(spec.seed + params.n - 1)  # leg i runs with seed + i
    except APIError as e:
        raise vllm_error(e) from None
    return spec


def structured_json(structured: StructuredOutputsParams | None) -> str | None:
    """The constraint and options a request set, as the JSON object a replica rebuilds them from
    (the backend vLLM picked is left out: each engine picks its own, as for any request it gets)."""
    if structured is None:
        return None
    fields = (f for f in dataclasses.fields(structured) if f.init)
    return json.dumps({f.name: getattr(structured, f.name) for f in fields if getattr(structured, f.name) != f.default})


def check_prompt(ids: list[int], vocab_size: int) -> None:
    """A prompt the engines can take: at least one token, every id in the vocabulary (the input
    processing vLLM's engine client does before its engine sees a prompt)."""
    if not ids:
        raise VLLMValidationError("the prompt must hold at least one token", parameter="prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise VLLMValidationError(f"prompt token ids must lie in [0, {vocab_size})", parameter="prompt")


def legs(request_id: str, prompt: list[int], spec: SamplingSpec, n: int, adapter, priority: int) -> list[ChoiceJob]:
    """One routed request per sample; seeds `seed + i`, as vLLM's parallel sampling gives them."""
    jobs = []
    for i in range(n):
        seed = None if spec.seed is None else spec.seed + i
        sampling = dataclasses.replace(spec, seed=seed)
        leg_id = request_id if n == 1 else f"{i}_{request_id}"
        req = GenerateRequest(leg_id, tuple(prompt), sampling, adapter, priority=priority)
        jobs.append(ChoiceJob(index=i, request=req))
    return jobs


# vLLM's floor for a logprob in a response; NaN (a fully masked row) too, so responses stay JSON.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def vllm_logprobs(logprobs: list[TokenLogprob]) -> list[dict[int, Logprob]]:
    """dlora's per-token logprobs in vLLM's shape: the sampled (or prompt) token first, with its
    rank, then the top alternatives by rank."""
    out = []
    for lp in logprobs:
        ranks = {token_id: rank for rank, (token_id, _, _) in enumerate(lp.top, start=1)}
        rank = lp.rank if lp.rank is not None else ranks.get(lp.token_id)
        step = {lp.token_id: Logprob(_finite(lp.logprob), rank, lp.token)}
        for token_id, logprob, token in lp.top:
            if token_id != lp.token_id:
                step[token_id] = Logprob(_finite(logprob), ranks[token_id], token)
        out.append(step)
    return out


@dataclass
class LegOutput:
    """What one leg has produced, and what the previous output already gave."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sent_text: int = 0  # characters / tokens already sent as deltas
    sent_tokens: int = 0

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            self.logprobs = (self.logprobs or []) + vllm_logprobs(d.logprobs)
            total = (self.cumulative_logprob or 0.0) + sum(lp.logprob for lp in d.logprobs)
            self.cumulative_logprob = _finite(total)
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def whole(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            self.logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )

    def delta(self) -> CompletionOutput:
        """What is new since the previous delta (and marks it sent)."""
        text, ids = self.text[self.sent_text :], self.token_ids[self.sent_tokens :]
        logprobs = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
        self.sent_text, self.sent_tokens = len(self.text), len(self.token_ids)
        return CompletionOutput(
            self.index,
            text,
            ids,
            self.cumulative_logprob,
            logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


@dataclass
class RequestOutputs:
    """A request's legs, turned into vLLM's `RequestOutput`s in its `output_kind`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    lora_request: LoRARequest | None
    legs: list[LegOutput]
    # From the first leg's first delta, in vLLM's shape (None for the first prompt token)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens found in the prefix cache and those written to it, from the first leg's first
    # delta (a moved leg's replica reports its own, which covers generated tokens too: the first is
    # the prompt's)
    num_cached_tokens: int | None = None
    num_cache_creation_tokens: int | None = None

    def add(self, index: int, d: Delta) -> None:
        self.legs[index].add(d)
        if d.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *vllm_logprobs(d.prompt_logprobs)]
        if d.cached_tokens is not None and self.num_cached_tokens is None:
            self.num_cached_tokens = d.cached_tokens
            self.num_cache_creation_tokens = d.cache_creation_tokens

    def after(self, index: int) -> RequestOutput | None:
        """The output to send after leg `index` produced something, if any."""
        leg = self.legs[index]
        finished = all(leg.finished for leg in self.legs)
        if self.kind == RequestOutputKind.FINAL_ONLY:
            return self._output([leg.whole() for leg in self.legs], True) if finished else None
        if self.kind == RequestOutputKind.DELTA:
            return self._output([leg.delta()], finished)
        return self._output([leg.whole()], finished)

    def aborted(self) -> RequestOutput:
        """The last output of a request stopped before its legs finished."""
        for leg in self.legs:
            if not leg.finished:
                leg.finish_reason = "abort"
        whole = self.kind != RequestOutputKind.DELTA
        return self._output([leg.whole() if whole else leg.delta() for leg in self.legs], True)

    def _output(self, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            self.prompt_logprobs,
            outputs,
            finished,
            lora_request=self.lora_request,
            num_cached_tokens=self.num_cached_tokens,
            num_cache_creation_tokens=self.num_cache_creation_tokens,
        )


class RouterEngineClient(EngineClient):
    """`EngineClient` over a server's router and adapters (`ServerState`): vLLM's serving classes
    generate through the cluster, with dlora's dispatch, migration and resubmission underneath."""

    def __init__(self, state: ServerState, vllm_config: VllmConfig, renderer) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer
        self.input_processor = InputProcessor(vllm_config, renderer)
        self._state = state
        self._stop: dict[str, asyncio.Queue] = {}

    def generate(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        **_unused: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Checks the request at once and runs it when iterated. vLLM's serving calls this before a
        stream's first byte, so a value the replicas refuse is a 400, not an error inside a 200
        stream."""
        components = extract_prompt_components(self.model_config, prompt)
        ids = list(components.token_ids or ())
        check_prompt(ids, self._state.vocab_size)
        # vLLM's own checks of the values against the model (what its engine client runs first).
        sampling_params.verify(
            self.model_config, None, self.vllm_config.structured_outputs_config, self.renderer.tokenizer
        )
        spec = spec_of(sampling_params, self._state.vocab_size)
        legs_out = [LegOutput(i) for i in range(sampling_params.n)]
        outputs = RequestOutputs(request_id, components.text, ids, sampling_params.output_kind, lora_request, legs_out)
        return self._run(outputs, spec, priority)

    async def _run(self, outputs: RequestOutputs, spec: SamplingSpec, priority: int) -> AsyncGenerator[RequestOutput]:
        request_id = outputs.request_id
        adapter = await self._adapter(outputs.lora_request)
        jobs = legs(request_id, outputs.prompt_token_ids, spec, len(outputs.legs), adapter, priority)
        queue: asyncio.Queue = asyncio.Queue()
        self._stop[request_id] = queue
        try:
            async for job, delta in run_jobs(self._state, jobs, adapter.name if adapter else "", queue):
                outputs.add(job.index, delta)
                out = outputs.after(job.index)
                if out is not None:
                    yield out
        except (VLLMError, GeneratorExit, asyncio.CancelledError):
            raise
        except Exception as e:
            # The cluster's refusals keep their status and message; anything else is logged under the
            # request id and reaches the client as a 500 without its text.
            raise vllm_error(as_api_error(e, request_id)) from None
        finally:
            self._stop.pop(request_id, None)
        if not all(leg.finished for leg in outputs.legs):  # ended by abort(request_id)
            yield outputs.aborted()

    async def _adapter(self, lora_request: LoRARequest | None) -> AdapterRef | None:
        if lora_request is None:
            return None
        try:
            return ref_of(await lookup_adapter(self._state.adapters, lora_request.lora_name))
        except APIError as e:
            raise vllm_error(e) from None

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            queue = self._stop.get(rid)
            if queue is not None:
                queue.put_nowait(STOP)

    # -- what the cluster answers for, or what an engine-less frontend has no use for --------------

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return False

    @property
    def errored(self) -> bool:
        """Only a cluster that can never serve again is dead (vLLM then shuts the server down)."""
        return False

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the cluster has no replica that can serve")

    async def check_health(self) -> None:
        if not self._state.router.may_serve_soon():
            raise RuntimeError("no replica is serving or starting")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        raise NotImplementedError("adapters are registered with dlora's admin API")

    def encode(self, *args, **kwargs):
        raise NotImplementedError("dlora serves generation only")

    async def is_tracing_enabled(self) -> bool:
        return False

    async def do_log_stats(self) -> None:
        return None

    async def notify_kv_transfer_request_rejected(self, *args, **kwargs) -> None:
        return None

    async def start_profile(self, *args, **kwargs) -> None:
        raise NotImplementedError("profiling runs on replicas")

    async def stop_profile(self) -> None:
        raise NotImplementedError("profiling runs on replicas")

    async def reset_mm_cache(self) -> None:
        return None

    async def reset_encoder_cache(self) -> None:
        return None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return False

    async def sleep(self, level: int = 1, mode="abort") -> None:
        raise NotImplementedError("replicas are drained, not put to sleep")

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return False

    async def is_sleeping(self) -> bool:
        return False

    async def pause_generation(self, *, mode="abort", clear_cache: bool = True) -> None:
        raise NotImplementedError("replicas are drained, not paused")

    async def resume_generation(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return False

    async def release_kv_cache_memory(self) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        return None
