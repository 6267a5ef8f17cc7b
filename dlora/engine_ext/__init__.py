"""Code that vLLM loads into its own processes: dlora's scheduler, worker extension and LoRA fixes.

Everything under `dlora/replica/` runs on the host side of a replica (the Ray actor, the AsyncLLM
wrapper, the messages crossing the actor boundary); everything here is imported by vLLM itself,
from class paths dlora hands it, inside its EngineCore process (the scheduler) or its worker
process (the model runner). On a replica the EngineCore is a process of its own, which vLLM's
`AsyncLLM` always spawns from the Ray actor, and with one worker the model runner runs inside that
EngineCore process (vLLM's single-process executor); the code is still written for the split, since
only RPCs (`call_utility_async`, `collective_rpc`) and the step's scheduler/model-runner outputs
cross between them.

Every seam where dlora hooks into vLLM 0.32.0, and nothing else touches vLLM's internals:

| vLLM symbol | our file | process | why |
|---|---|---|---|
| `EngineArgs.scheduler_cls` = `dlora.engine_ext.scheduler.DloraScheduler` (set in `dlora/replica/engine.py`) | `scheduler.py` | EngineCore | the batching policy decides every step which requests run and whether the weights are merged |
| `EngineArgs.additional_config[BATCHING_CONFIG_KEY]` | `scheduler.py` (`policy_from`) | EngineCore | carries the policy's name and settings from `dlora.yaml` into the scheduler |
| `EngineArgs.worker_extension_cls` = `dlora.engine_ext.worker.DloraWorkerExtension` | `worker.py` | worker | its `dlora_*` methods become `collective_rpc` calls: install hooks, pin, clear slots, prepare merges |
| `setattr(EngineCore, "dlora_setup" / "dlora_batching_state")` at import of `scheduler.py` | `scheduler.py` | EngineCore | utilities the host reaches with `engine_core.call_utility_async(...)`; the state comes back as the `BatchingState` message (built by `batching_state.py`; msgpack, rebuilt by `dlora.replica.messages.from_wire`), its samples numbered (`samples.py`) so a read takes nothing away |
| `KVCacheManager.get_computed_blocks`, replaced on the scheduler's instance (`PrefixLookup`, built by `scheduler.py`) | `prefix_lookup.py` + `prefix_filter.py` + `prefix_states.py` | EngineCore | a prefix-cache hit must come from blocks computed in the weight state the step runs in |
| `Scheduler.running` / `waiting` / `kv_holding_waiting`, hidden around `super().schedule()` | `scheduler.py` + `queue_hiding.py` | EngineCore | requests the policy holds back keep their KV blocks and are never preempted |
| `Scheduler._handle_blocked_waiting_request`, overridden; `SamplingParams.extra_args[GENERATED_BEFORE_KEY]` (set in `dlora/replica/engine.py`) | `scheduler.py` + `grammar_replay.py` | EngineCore | once a moved request's grammar is compiled, the tokens its earlier legs generated are fed to it, so its structured output resumes instead of starting over |
| `EngineArgs.logits_processors` = `dlora.engine_ext.continuation_logits:ContinuationLogits` (a vLLM `AdapterLogitsProcessor`; set in `dlora/replica/engine.py`) | `continuation_logits.py` | worker | a moved request's presence and frequency penalties and its bad words cover the tokens of its earlier legs, which its continuation holds as prompt |
| `Scheduler.add_request` / `finish_requests` / `_free_request` / `_preempt_request`, overridden | `scheduler.py` + `step_measures.py` | EngineCore | a request's client priority and queue wait are kept from arrival to its end (every finished request passes `_free_request`); preemptions are counted |
| `SchedulerOutput.dlora_cmds`, `ModelRunnerOutput.dlora_reports` (attributes set with `setattr`) | `inband.py` | EngineCore and worker | merge/unmerge commands ride on the step that needs them; their reports ride back |
| the model runner's `execute_model` / `sample_tokens` / `_set_active_loras`, wrapped on its instance (`dlora_install`) | `worker.py` | worker | apply the step's switch commands before its forward pass; keep a merged adapter's tokens off the LoRA term |
| `AsyncModelRunnerOutput.get_output`, wrapped on each step's instance | `worker.py` | worker | executors unwrap the async output and would drop the reports set on the wrapper |
| `reload_weights` (`vllm.model_executor.model_loader.reload.inplace`), with its loggers filtered | `worker.py` + `merge.py` | worker | the merge path for prepacked CPU, quantized and tensor-parallel layers |
| `LRUCacheLoRAModelManager._pin_lora_in_cpu_cache` (the runner's `lora_manager._adapter_manager`) | `worker.py` | worker | pin an adapter in the host LoRA cache without taking a device slot the scheduler does not count |
| `LoRAModelManager` slots (`lora_index_to_id`, `reset_lora`) | `lora_slot_clear.py` | worker | zero a removed adapter's slot so no kernel reads its weights again; report which adapters hold slots (`/v1/adapters`' device state) |
| `WorkerLoRAManager._load_adapter`, wrapped on the model runner's `lora_manager` instance (`lora_prefetch.install`, from the `dlora_prefetch_*` RPCs) | `lora_prefetch.py` | worker | a cold adapter is read and built in a background thread while the engine steps; vLLM's `add_lora` then only inserts the prefetched model, so running requests do not stall for the read |
| `Platform.get_punica_wrapper`, replaced on the platform class (`lora_backend.install`) | `lora_backend.py` | worker | makes vLLM build dlora's punica wrapper (`engine.lora_backend: einsum / triton`) |
| `PunicaWrapperCPU` / `PunicaWrapperGPU`, subclassed | `punica_wrapper.py` | worker | LoRA linears on dlora's kernels, and mixed merged steps (subtracting the merged adapter's delta) |
| `vllm.lora.ops.torch_ops.lora_ops.bgmv_*` and `punica_cpu.bgmv_*`, replaced (`cpu_lora_fix.install`) | `cpu_lora_fix.py` | worker | vLLM's CPU ops give base-model tokens (index -1) the last slot's adapter |
| `tokenizers.decoders.DecodeStream`, replaced by `dlora/replica/decode_stream.py` (`install`, from `EngineHost.start`) | `../replica/decode_stream.py` | replica host (AsyncLLM's output processor) | tokenizers' stream echoes the whole prompt when the prompt's text ends in half a character, as a request moved right after such a token does |
| `OpenAIServingModels`, subclassed (`lora_requests` a view of dlora's registry, `check_model` / `resolve_lora` dlora's lookup); `OpenAIServingCompletion`, `OpenAIServingChat`, `OpenAIServingResponses`, `ServingTokenization`, subclassed only for `_check_model` (dlora's lookup), for chat and responses the rendering (a render timeout is a 400; `render_chat_request`, `_render_resolved_response_inputs`) and, for responses, `create_responses` (the server names the request, not the body's `request_id`; the prompt is tokenized as a chat's, without the second BOS vLLM 0.32 adds); their route functions (and the models listing's) mounted as they are; `EngineClient` implemented over the router | `../server/vllm_frontend.py`, `../server/engine_client.py` | API server | vLLM's own frontend code answers over dlora's adapters and cluster instead of a re-typed copy |
| `EngineClient`, implemented over the router (`RouterEngineClient`: `generate` runs n legs through dispatch, migration and resubmission and answers in vLLM's `RequestOutput`s) | `../server/engine_client.py` | API server | vLLM's own serving classes (completions, chat, ...) generate through the cluster instead of a local engine |
| imports with side effects: `worker.py` runs `cpu_lora_fix.install()` and `lora_backend.install()`; `scheduler.py` adds the EngineCore utilities | `worker.py`, `scheduler.py` | worker, EngineCore | vLLM imports these modules before the model is built and before the first step, the only moment the patches can take effect |

Modules without a seam of their own: `merge.py`, `adapter_factors.py`, `checkpoint_tensors.py`,
`live_weights.py` and `pristine_rows.py` (the weight merger, worker); `lora_step_pass.py`,
`packed_stacks.py` and `onednn_gemm.py` (the punica wrapper's parts, worker); `step_plan.py` (what a
step runs), `weight_state.py` and `switch_times.py` (the worker's weights), `step_measures.py`,
`samples.py`, `queue_waits.py`, `batching_state.py` and `step_trace.py` (scheduler bookkeeping),
all EngineCore and pure: the scheduler calls them over plain data.
`lora_backend.check` also runs in the server process, before any replica starts.

This `__init__` imports nothing: importing `dlora.engine_ext.worker` patches vLLM, so only vLLM
(or a test that means to) may import it.
"""
