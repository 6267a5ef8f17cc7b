"""One vLLM AsyncLLM engine with LoRA enabled, driven by plain dlora messages.

`EngineHost` is what a replica actor runs; it holds no Ray code, so it also runs in-process.
It turns `GenerateRequest`s into vLLM calls and vLLM outputs into `Delta`s (token ids, text,
logprobs), and it loads, pins and unloads adapters by their registry ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from dlora.config import DloraConfig
from dlora.replica import adapter_source, decode_stream
from dlora.replica.adapter_paths import AdapterPaths
from dlora.replica.adapter_source import AdapterSource
from dlora.replica.engine_keys import BACKGROUND_PRIORITY_KEY, BATCHING_CONFIG_KEY, GENERATED_BEFORE_KEY
from dlora.replica.errors import EngineNotStarted
from dlora.replica.messages import (
    AdapterRef,
    BatchingState,
    Delta,
    GenerateRequest,
    SamplingSpec,
    TokenLogprob,
    by_adapter_name,
    from_wire,
)
from dlora.replica.node_cache import NodeAdapterCache
from dlora.waits import wait_event

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger(__name__)

WORKER_EXTENSION = "dlora.engine_ext.worker.DloraWorkerExtension"
SCHEDULER = "dlora.engine_ext.scheduler.DloraScheduler"
CONTINUATION_LOGITS = "dlora.engine_ext.continuation_logits:ContinuationLogits"
ABORT_RETRY_S = 0.01  # how often an abort that came before vLLM knew its request is repeated
# How long an abort that came before its request's stream waits for that stream. Ray runs an async
# actor's calls concurrently, so a migration's abort can overtake the generate call it follows by
# milliseconds; much older ones are for requests that ended (and whose id a later leg may reuse).
EARLY_ABORT_TTL_S = 10.0
# How often a cold adapter's background read is polled: each poll is one utility call between two
# steps, so about one a step; the load ends at most this long after its read.
PREFETCH_POLL_S = 0.01


def build_engine_args(cfg: DloraConfig, model_path: str):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(cfg, model_path))


def engine_kwargs(cfg: DloraConfig, model_path: str) -> dict:
    """vLLM's engine arguments for a replica (also what the in-process test engines start from)."""
    from vllm.config import StructuredOutputsConfig

    e = cfg.engine
    return dict(
        model=model_path,
        dtype=cfg.model.dtype,
        max_model_len=cfg.model.max_model_len,
        seed=cfg.model.seed,
        # Read by the API process's frontend for its sampling defaults (vLLM's server does the same).
        generation_config=cfg.model.generation_config,
        structured_outputs_config=StructuredOutputsConfig(
            backend=e.structured_outputs_backend,  # type: ignore[arg-type]  # one of vLLM's: config.py checks
            disable_any_whitespace=e.structured_outputs_disable_any_whitespace,
            # A reasoning model's structured output constrains only the answer after its thinking:
            # the engine's grammar must know where thinking ends (vLLM's server passes it the same way).
            reasoning_parser=cfg.server.reasoning_parser or "",
        ),
        enable_lora=True,
        max_loras=e.max_loras,
        max_lora_rank=e.max_lora_rank,
        max_cpu_loras=e.max_cpu_loras,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        enable_prefix_caching=e.enable_prefix_caching,
        num_gpu_blocks_override=e.num_kv_blocks,
        enforce_eager=e.enforce_eager,
        # Waiting requests go by (priority, first arrival in the cluster): FCFS while every priority
        # is 0, and a leg moved here keeps its place in line instead of joining the tail (engine_input).
        scheduling_policy="priority",
        disable_log_stats=True,
        worker_extension_cls=WORKER_EXTENSION,
        logits_processors=[CONTINUATION_LOGITS],
        scheduler_cls=SCHEDULER,
        # The scheduler switches weights in-band and must see each step's result before planning
        # the next one (CPU forces this anyway; see engine_ext/scheduler.py for GPU).
        async_scheduling=False,
        additional_config={
            BATCHING_CONFIG_KEY: cfg.scheduling.to_engine(),
            BACKGROUND_PRIORITY_KEY: cfg.batch.priority,
        },
    )


def to_sampling_params(s: SamplingSpec):
    from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

    structured = None if s.structured_outputs is None else StructuredOutputsParams(**json.loads(s.structured_outputs))
    return SamplingParams(
        n=1,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
        logit_bias=dict(s.logit_bias) or None,
        allowed_token_ids=None if s.allowed_token_ids is None else list(s.allowed_token_ids),
        bad_words=list(s.bad_words) or None,
        structured_outputs=structured,
        extra_args={GENERATED_BEFORE_KEY: s.generated_before} if s.generated_before else None,
        output_kind=RequestOutputKind.DELTA,
    )


def external_request_id(engine_id: str, randomized: bool = True) -> str:
    """The id dlora gave a request, from the one vLLM's engine core knows it by: vLLM appends "-" and
    8 random characters to every request id (`InputProcessor.assign_request_id`) unless
    VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set (`randomized` False)."""
    return engine_id.rsplit("-", 1)[0] if randomized else engine_id


def engine_input(engine, req: GenerateRequest):
    """The request's token prompt rendered as vLLM's own API server renders it, stamped with the
    request's first arrival: vLLM would stamp the time it reaches this engine."""
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, {"prompt_token_ids": list(req.prompt_token_ids)})
    (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
    if req.arrival_time is not None:
        rendered["arrival_time"] = req.arrival_time
    return rendered


def node_cache_root(cfg: DloraConfig) -> Path:
    """`engine.node_cache_dir`, else a per-user directory under this node's temp dir."""
    if cfg.engine.node_cache_dir:
        return Path(cfg.engine.node_cache_dir).expanduser()
    return Path(tempfile.gettempdir()) / f"dlora-node-cache-{os.getuid()}"


def _lora_request(ref: AdapterRef | None):
    if ref is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(ref.engine_name, ref.int_id, ref.path)


def _convert_logprobs(token_ids: list[int], logprobs, k: int) -> list[TokenLogprob] | None:
    """vLLM gives the sampled token plus the top k; OpenAI wants exactly the top k as alternatives."""
    if logprobs is None:
        return None
    out = []
    for tid, position in zip(token_ids, logprobs):
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)
        chosen = position[tid]
        top = tuple((t, lp.logprob, lp.decoded_token or "") for t, lp in ranked if lp.rank and lp.rank <= k)
        out.append(TokenLogprob(tid, chosen.logprob, chosen.decoded_token or "", top, chosen.rank))
    return out


class EngineHost:
    def __init__(
        self,
        cfg: DloraConfig,
        model_path: str,
        node: str | None = None,
        fetch: Callable[[AdapterSource], Mapping[str, bytes]] = adapter_source.fetch,
    ):
        self.cfg = cfg
        self.model_path = model_path
        self.node = node or socket.gethostname()  # named in errors about this replica's node
        cache = NodeAdapterCache(node_cache_root(cfg), int(cfg.engine.node_cache_mib * (1 << 20)), self.node)
        self.adapter_paths = AdapterPaths(cache, fetch)
        self.engine: AsyncLLM | None = None
        # request id -> set when its stream has ended (see abort)
        self._streams: dict[str, asyncio.Event] = {}
        self._retries: set[asyncio.Task] = set()
        # request id -> when an abort for it came before its stream started (see generate)
        self._early_aborts: dict[str, float] = {}

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        decode_stream.install()  # before the engine's output processor makes its first stream
        self._early_aborts.clear()  # a new engine: every request the old one knew of has failed

        self.engine = AsyncLLM.from_engine_args(build_engine_args(self.cfg, self.model_path))
        # Install the worker hooks for merged/unmerged switching, then let the scheduler merge.
        await self.engine.engine_core.call_utility_async("dlora_setup")

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _started(self):
        """The engine, or EngineNotStarted (a replica failure: the router rebuilds the replica)."""
        if self.engine is None:
            raise EngineNotStarted(
                f"no engine for {self.model_path!r} in process {os.getpid()}: not started yet, shut down, "
                "or the actor was restarted (e.g. after the OOM killer) and must be started again"
            )
        return self.engine

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        if self._take_early_abort(req.request_id):
            # Its abort overtook it: end it as vLLM ends an aborted request, without running it.
            yield Delta(token_ids=[], text="", finished=True, finish_reason="abort")
            return
        engine = self._started()
        adapter = None if req.adapter is None else await self.adapter_paths.local(req.adapter)
        stream = engine.generate(
            engine_input(engine, req),
            to_sampling_params(req.sampling),
            req.request_id,
            lora_request=_lora_request(adapter),
            priority=req.priority,
        )
        ended = self._streams[req.request_id] = asyncio.Event()
        prompt_k = req.sampling.prompt_logprobs
        first = True
        try:
            async for out in stream:
                c = out.outputs[0]
                ids = list(c.token_ids)
                prompt = None
                if prompt_k is not None and out.prompt_logprobs is not None:
                    prompt = _convert_logprobs(list(req.prompt_token_ids[1:]), out.prompt_logprobs[1:], prompt_k)
                    prompt_k = None  # vLLM gives them with the first output only
                yield Delta(
                    token_ids=ids,
                    text=c.text,
                    logprobs=_convert_logprobs(ids, c.logprobs, req.sampling.logprobs or 0),
                    prompt_logprobs=prompt,
                    finished=out.finished,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    cached_tokens=(out.num_cached_tokens or 0) if first else None,
                    cache_creation_tokens=(out.num_cache_creation_tokens or 0) if first else None,
                )
                first = False
        finally:
            ended.set()
            if self._streams.get(req.request_id) is ended:
                del self._streams[req.request_id]

    async def abort(self, request_id: str) -> None:
        if self.engine is None:
            # Nothing runs without an engine, so the request is already gone. Not an error: the
            # router-side handle sends this abort fire-and-forget after a stream fails, typically
            # to a restarted actor, and an error there would only be an unretrieved Ray error.
            log.debug("abort %s: no engine, nothing to abort", request_id)
            return
        await self.engine.abort(request_id)
        ended = self._streams.get(request_id)
        if ended is None:
            self._remember_early_abort(request_id)
        elif not ended.is_set():
            # vLLM registers a request only once its inputs are processed off the event loop, and an
            # abort before that finds nothing: the request would run to its end (a lost migration,
            # a disconnected client's tokens computed anyway). Repeat it until the stream ends.
            task = asyncio.create_task(self._abort_until_ended(request_id, ended))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    def _remember_early_abort(self, request_id: str) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._early_aborts.items() if now - t > EARLY_ABORT_TTL_S]:
            del self._early_aborts[rid]
        self._early_aborts[request_id] = now

    def _take_early_abort(self, request_id: str) -> bool:
        came = self._early_aborts.pop(request_id, None)
        return came is not None and time.monotonic() - came <= EARLY_ABORT_TTL_S

    async def _abort_until_ended(self, request_id: str, ended: asyncio.Event) -> None:
        while not ended.is_set() and self.engine is not None:
            if not await wait_event(ended, ABORT_RETRY_S):
                try:
                    await self.engine.abort(request_id)
                except Exception as e:  # the engine died: its streams fail, and the router resubmits them
                    log.debug("abort %s: repeat failed (%s); the stream ends as a replica failure", request_id, e)
                    return

    async def add_adapter(self, ref: AdapterRef, pinned: bool = False) -> None:
        """Load an adapter into the engine's host cache (raises on a bad adapter, engine unharmed)."""
        engine = self._started()
        ref = await self.adapter_paths.local(ref)  # a path on this node, the files verified
        if self.cfg.engine.prefetch_adapters:
            await self._prefetch(engine, ref)
        await engine.add_lora(_lora_request(ref))
        if pinned:
            # Host cache only: vLLM's pin_lora also pins a device slot, which its scheduler does not
            # count, so a batch of max_loras other adapters then fails inside the engine.
            await engine.collective_rpc("dlora_pin_lora", args=(ref.int_id,))
        if self.cfg.scheduling.policy != "unmerged":
            # The first merge of an adapter is a full reload (a stall of every running request);
            # prepared now, between steps, it is a swap when the policy merges it (engine_ext/worker.py).
            await engine.collective_rpc("dlora_prepare_merge", args=(ref.path,))

    async def _prefetch(self, engine, ref: AdapterRef) -> None:
        """Read the adapter's files in the engine's background thread and wait for it here, with
        small sleeps, while the engine keeps stepping (engine_ext/lora_prefetch.py). A read that
        failed raises from the `add_lora` that follows, as vLLM's own load would."""
        await engine.collective_rpc("dlora_prefetch_lora", args=(ref.engine_name, ref.int_id, ref.path))
        while not all(await engine.collective_rpc("dlora_prefetch_done", args=(ref.int_id,))):
            await asyncio.sleep(PREFETCH_POLL_S)

    async def remove_adapter(self, int_id: int) -> bool:
        """Unload an adapter and zero the LoRA slot it held: vLLM's unload keeps the slot's weights,
        which dlora's einsum kernels still read (see lora_slot_clear.py)."""
        engine = self._started()
        removed = await engine.remove_lora(int_id)
        await engine.collective_rpc("dlora_clear_free_lora_slots")
        self.adapter_paths.forget(int_id)
        return removed

    async def resident_adapter_ids(self) -> list[int]:
        return sorted(await self._started().list_loras())

    async def device_adapter_ids(self) -> list[int]:
        """Adapter ids active in the engine's LoRA device slots (one read per worker, merged)."""
        per_worker = await self._started().collective_rpc("dlora_device_lora_ids")
        return sorted({i for ids in per_worker for i in ids})

    async def batching_state(self, since: int = 0) -> BatchingState:
        """The batching state kept by the scheduler inside the engine-core process, with the measured
        samples numbered after `since` (the `samples_seq` of the caller's previous read; 0: all the
        engine keeps). A read changes nothing there, so two readers never take each other's samples."""
        from vllm import envs

        raw = await self._started().engine_core.call_utility_async("dlora_batching_state", since)
        state = from_wire(BatchingState, raw)
        randomized = not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
        waits = tuple((external_request_id(rid, randomized), s) for rid, s in state.queue_waits)
        preempted = tuple(external_request_id(rid, randomized) for rid in state.preempted)
        return by_adapter_name(dataclasses.replace(state, queue_waits=waits, preempted=preempted))

    def num_unfinished(self) -> int:
        return self.engine.get_num_unfinished_requests() if self.engine else 0

    async def check_health(self) -> None:
        await self._started().check_health()
