"""dlora's worker extension for vLLM (`worker_extension_cls`).

Runs inside vLLM's worker process.

vLLM imports this module inside the engine's worker process before the model is built, which is
where dlora's fixes to vLLM's CPU LoRA path must be in force. Methods added here become RPCs
(`collective_rpc`); vLLM forbids overriding Worker attributes, so every name carries a `dlora_`
prefix, and the hooks on the model runner are instance-attribute wrappers installed by
`dlora_install` (called once by the engine core right after start-up, see `scheduler.py`):

- `execute_model`: applies the step's in-band merge/unmerge commands (`inband.py`) before the
  forward pass, so the weights change together with the batch the scheduler chose for them, and
  hands the worker's reports (ok/failed, seconds) back on that step's ModelRunnerOutput;
- `sample_tokens`: the same hand-back when vLLM splits a step into execute + sample. When the
  model runner returns an `AsyncModelRunnerOutput` (vLLM's V2 runner always does, the V1 runner
  with async scheduling), the reports ride on its `get_output()`: the executor resolves the
  wrapper into the inner ModelRunnerOutput and would otherwise drop them;
- `_set_active_loras`: while adapter X is merged its delta is in the weights already, so X's
  tokens must get no LoRA term (applying both would count it twice). With dlora's LoRA backends
  (einsum, triton) X stays active, holding a slot even in a step without X's tokens, and the
  model's punica wrapper is told X's slot: it skips X's tokens and subtracts X's delta from every
  other token, so other adapters and the base model run in the same step (`punica_wrapper.py`,
  "mixed merged steps"). With vLLM's own ops (`vllm` backend), which cannot compensate, X's lora
  id is mapped to 0 (no LoRA) and X leaves the active set; the scheduler then runs X alone.
  `dlora_can_mix` tells the engine core which of the two a worker does.

A switch that raises an unexpected exception (anything but the merger's all-or-nothing
MergeError) does not stop the engine: the LoRA bookkeeping is brought in line with the merger's
own record (`_Switcher.reconcile`), and the report says the weights are unknown, so the scheduler
restores and confirms the base weights before it runs anything else (`weight_state.py`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import TYPE_CHECKING

from vllm.v1.outputs import AsyncModelRunnerOutput

from dlora import env
from dlora.engine_ext import cpu_lora_fix, lora_backend
from dlora.engine_ext.inband import CMDS_ATTR, MERGE, REPORTS_ATTR, UNMERGE, SwitchCommand, SwitchReport
from dlora.engine_ext.merge import CheckpointTensors, MergeError, ParameterViews, WeightMerger

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

cpu_lora_fix.install()
lora_backend.install(env.DLORA_LORA_BACKEND.get())  # engine.lora_backend, before the model is built

log = logging.getLogger(__name__)

# vLLM warns about every module a reload leaves alone; a dlora reload leaves most alone on purpose.
_PARTIAL_RELOAD_WARNINGS = {
    "vllm.model_executor.model_loader.reload.inplace": "Following weights were not loaded",
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _quiet_partial_reload():
    filters = [(logging.getLogger(name), _DropMessage(prefix)) for name, prefix in _PARTIAL_RELOAD_WARNINGS.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


# Merged kernels of recently merged adapters are kept for a cheap re-merge, up to
# engine.merged_cache_mib of merged weights (LRU; env.DLORA_MERGED_CACHE_MIB in this process). The
# device path (in place, `LiveWeights`) keeps none: its merge is itself a few kernels.
def merged_cache_bytes() -> int:
    return int(env.DLORA_MERGED_CACHE_MIB.get() * 2**20)


class _CpuKernels:
    """`KernelStates` for vLLM's CPU linear layers: after loading, the weight lives only in the
    prepacked GEMM closure `layer.cpu_linear` (the `weight` parameter is emptied), so that closure
    is the module's whole compute state."""

    def __init__(self, model) -> None:
        self.model = model

    def _layer(self, name: str):
        from vllm.lora.layers import BaseLayerWithLoRA

        module = self.model.get_submodule(name)
        return module.base_layer if isinstance(module, BaseLayerWithLoRA) else module

    def capture(self, modules):
        states = {}
        for name in modules:
            layer = self._layer(name)
            fn, weight = getattr(layer, "cpu_linear", None), getattr(layer, "weight", None)
            if fn is None or weight is None or weight.numel() != 0 or getattr(layer, "bias", None) is not None:
                return None  # the weights are (also) in tensors a reload overwrites in place
            states[name] = fn
        return states

    def apply(self, states) -> None:
        for name, fn in states.items():
            self._layer(name).cpu_linear = fn


def plain_linear(layer) -> bool:
    """True if `layer` is an unquantized vLLM linear layer whose forward reads `layer.weight` as
    is, so an in-place edit of it is what the next step computes with (the in-place merge).

    Prepacked CPU layers fail the shape check in `ParameterViews` (vLLM empties their `weight`
    after packing it into `cpu_linear`); a CPU layer that kept its weight runs torch's
    `F.linear` on it. Quantized layers keep other tensors: never merged in place.
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return isinstance(layer, LinearBase) and isinstance(getattr(layer, "quant_method", None), UnquantizedLinearMethod)


def _mixing_wrapper(runner):
    """The language model's punica wrapper if it can compensate a merged adapter (dlora's
    backends), else None. Fully sharded LoRA layers bypass `add_lora_linear`: never mixed."""
    from dlora.engine_ext.punica_wrapper import DloraLinearMixin

    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    if manager is None or manager.lora_config.fully_sharded_loras:
        return None
    wrapper = manager._get_punica_wrapper(manager.mm_mapping.language_model[0] if manager.supports_mm else "")
    return wrapper if isinstance(wrapper, DloraLinearMixin) else None


def _with_reports(output, reports: list[SwitchReport]):
    # Early-return outputs may be a shared module-level constant: never mutate that one.
    output = copy.copy(output)
    setattr(output, REPORTS_ATTR, reports)
    return output


def _reports_on_resolve(output: AsyncModelRunnerOutput, reports: list[SwitchReport]) -> AsyncModelRunnerOutput:
    """Make `output.get_output()` return the resolved ModelRunnerOutput with `reports` on it.

    Executors never pass the wrapper on: the uniproc and multiproc executors (and their futures)
    call `get_output()` and hand the scheduler what it returns, so reports set on the wrapper
    itself would be lost. Patched on this instance only; it is built anew every step.
    """
    resolve = output.get_output

    def get_output():
        return _with_reports(resolve(), reports)

    output.get_output = get_output  # type: ignore[method-assign]  # on purpose, this instance only
    return output


class _Faults:
    """Test seam: faults the engine tests inject with `dlora_inject_fault` (none in serving).

    DROP loses the next step's reports, DELAY hands them over one step late, RAISE makes the next
    successful merge raise before its bookkeeping (the weights merged, the worker unsure).
    """

    DROP, DELAY, RAISE = "drop_reports", "delay_reports", "raise_after_merge"

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    def hit(self, kind: str) -> bool:
        """True (and one fewer left) if a `kind` fault is armed."""
        n = self.left.get(kind, 0)
        if n > 0:
            self.left[kind] = n - 1
        return n > 0


class _Switcher:
    """The worker-side state: the merger, how merged tokens skip their LoRA term (the mixing
    wrapper, or the lora-id remap), and the reports of the current step."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.faults = _Faults()
        self.runner = worker.model_runner
        self._merger: WeightMerger | None = None
        self.merged_adapter: str | None = None
        self.wrapper = _mixing_wrapper(self.runner)  # None: the `vllm` backend, remap instead
        self.merged_lora: LoRARequest | None = None  # the merged adapter's LoRARequest, kept active (mixing only)
        self.remap: frozenset[int] = frozenset()
        self.pending: list[SwitchReport] = []  # reports of the step in progress
        self.late: list[SwitchReport] = []  # held back one step (a `_Faults` delay)
        self.applied = 0

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self) -> None:
        runner = self.runner
        orig_execute, orig_sample, orig_set = (runner.execute_model, runner.sample_tokens, runner._set_active_loras)

        def execute_model(scheduler_output, *args, **kwargs):
            cmds = getattr(scheduler_output, CMDS_ATTR, None)
            if cmds:
                self.pending += [self.run(c) for c in cmds]
            return self.attach(orig_execute(scheduler_output, *args, **kwargs))

        def sample_tokens(*args, **kwargs):
            return self.attach(orig_sample(*args, **kwargs))

        def set_active_loras(prompt_mapping, token_mapping, lora_requests, *args, **kwargs):
            remap, kept = self.remap, self.merged_lora
            if remap:
                prompt_mapping = tuple(0 if i in remap else i for i in prompt_mapping)
                token_mapping = tuple(0 if i in remap else i for i in token_mapping)
                lora_requests = {r for r in lora_requests if r.lora_int_id not in remap}
            if kept is not None and all(r.lora_int_id != kept.lora_int_id for r in lora_requests):
                lora_requests = {*lora_requests, kept}  # the scheduler counted its slot
            result = orig_set(prompt_mapping, token_mapping, lora_requests, *args, **kwargs)
            if self.wrapper is not None:
                self.wrapper.dlora_set_merged_slot(self.merged_slot())
            return result

        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens
        runner._set_active_loras = set_active_loras

    def merged_slot(self) -> int | None:
        """The LoRA slot the merged adapter occupies (it was just activated, so it has one)."""
        if self.merged_lora is None:
            return None
        return self.runner.lora_manager._adapter_manager.lora_index_to_id.index(self.merged_lora.lora_int_id)

    def attach(self, output):
        """Put the pending reports on the step's output (None: sample_tokens will come)."""
        if output is None:
            return output
        reports = self._take_reports()
        if not reports:
            return output
        if isinstance(output, AsyncModelRunnerOutput):
            return _reports_on_resolve(output, reports)
        return _with_reports(output, reports)

    def _take_reports(self) -> list[SwitchReport]:
        reports, self.pending, self.late = self.late + self.pending, [], []
        if reports and self.faults.hit(_Faults.DROP):
            return []
        if reports and self.faults.hit(_Faults.DELAY):
            self.late = reports
            return []
        return reports

    # ---- switching -----------------------------------------------------------------------------

    def merger(self) -> WeightMerger:
        if self._merger is None:
            from vllm.model_executor.model_loader.reload.inplace import reload_weights
            from vllm.platforms import current_platform

            config = self.worker.vllm_config
            model = self.runner.get_model()

            def reload(items):
                with _quiet_partial_reload():
                    reload_weights(config, model, weights_iterator=items, weights_path=None, is_checkpoint_format=True)

            checkpoint = CheckpointTensors(config.model_config.model)
            packed = getattr(model, "packed_modules_mapping", {})
            kernels = _CpuKernels(model) if current_platform.is_cpu() else None
            # Strategy, per merge: in place where every touched weight is a plain parameter at
            # tensor parallel size 1 (CUDA; CPU layers vLLM did not prepack), else the reload
            # (prepacked CPU layers, quantized layers, tensor parallelism, unknown layouts).
            live = ParameterViews(model, packed, plain_linear) if self._tp_size() == 1 else None
            self._merger = WeightMerger(
                checkpoint, reload, packed, config.model_config.dtype, kernels, merged_cache_bytes(), live
            )
        return self._merger

    def _tp_size(self) -> int:
        return self.worker.vllm_config.parallel_config.tensor_parallel_size

    def run(self, cmd: SwitchCommand) -> SwitchReport:
        """`apply`, reporting an unexpected exception instead of raising it (module docstring)."""
        t0 = time.perf_counter()
        try:
            return self.apply(cmd)
        except Exception as e:
            log.exception("dlora %s of adapter %r raised; reporting the weights as unknown", cmd.op, cmd.adapter)
            self.reconcile(cmd)
            return SwitchReport(
                cmd.op, cmd.adapter, False, time.perf_counter() - t0, repr(e), cmd.seq, weights_known=False
            )

    def reconcile(self, cmd: SwitchCommand) -> None:
        """After `cmd` raised: trust only the merger's record, which is set once a merge is
        complete (`WeightMerger`). `cmd`'s adapter recorded as merged: remap it as merged. Anything
        else: put the base weights back, so this step's forward pass runs on weights that match
        the bookkeeping; if even that raises, the engine stops rather than serve on unknown weights."""
        merger = self._merger
        if cmd.op == MERGE and merger is not None and merger.merged == cmd.path:
            self._set_merged(cmd)
            return
        if merger is not None:
            merger.unmerge()
        self._set_merged(None)

    def apply(self, cmd: SwitchCommand) -> SwitchReport:
        t0 = time.perf_counter()
        if cmd.op == MERGE:
            assert cmd.path is not None  # a MERGE names its adapter directory (the scheduler, dlora_apply)
            try:
                self.merger().merge(cmd.path)
            except MergeError as e:
                # The merger restored the base weights; the step runs the adapter unmerged.
                self._set_merged(None)
                log.warning("merge of adapter %r failed, staying unmerged: %s", cmd.adapter, e)
                return SwitchReport(MERGE, cmd.adapter, False, time.perf_counter() - t0, str(e), cmd.seq)
            if self.faults.hit(_Faults.RAISE):
                raise RuntimeError("injected fault: raised after the merge, before its bookkeeping")
            self._set_merged(cmd)
        elif cmd.op == UNMERGE:
            if self._merger is not None:
                self._merger.unmerge()  # raises only if the pristine reload fails: engine stops
            self._set_merged(None)
        else:
            raise ValueError(f"unknown dlora switch command {cmd!r}")
        self.applied += 1
        return SwitchReport(cmd.op, cmd.adapter, True, time.perf_counter() - t0, seq=cmd.seq)

    def _set_merged(self, cmd: SwitchCommand | None) -> None:
        """The weights now hold `cmd`'s adapter (None: the base weights)."""
        from vllm.lora.request import LoRARequest

        self.merged_adapter = None if cmd is None else cmd.adapter
        self.merged_lora = None
        self.remap = frozenset()
        if cmd is not None and self.wrapper is not None:  # mixing: the wrapper compensates
            assert cmd.adapter is not None and cmd.path is not None  # a MERGE names both
            self.merged_lora = LoRARequest(cmd.adapter, cmd.lora_int_id, cmd.path)
        elif cmd is not None:
            self.remap = frozenset({cmd.lora_int_id})
        if self.wrapper is not None and self.merged_lora is None:
            self.wrapper.dlora_set_merged_slot(None)  # at once: no LoRA call may see a stale slot


class DloraWorkerExtension:
    # vLLM mixes this class into its worker (`worker_extension_cls`): the worker's model runner
    # (on CPU a CPUModelRunner, a subclass).
    model_runner: GPUModelRunner
    _dlora_switcher: _Switcher  # set by dlora_install

    def dlora_clear_free_lora_slots(self) -> list[int]:
        """Zero the LoRA slots no adapter occupies and drop packed copies (`lora_slot_clear.py`)."""
        from dlora.engine_ext import lora_slot_clear

        return lora_slot_clear.clear_free_slots(self.model_runner)

    def dlora_device_lora_ids(self) -> list[int]:
        """Adapter ids holding a LoRA slot now (`lora_slot_clear.device_lora_ids`): a list read."""
        from dlora.engine_ext import lora_slot_clear

        return lora_slot_clear.device_lora_ids(self.model_runner)

    def dlora_lora_slots(self) -> list[dict]:
        """Each LoRA slot's adapter id and largest |weight| (`lora_slot_clear.slot_contents`)."""
        from dlora.engine_ext import lora_slot_clear

        return lora_slot_clear.slot_contents(self.model_runner)

    def dlora_inject_fault(self, kind: str, times: int = 1) -> dict:
        """Test seam: arm `times` faults of `kind` (`_Faults`); returns those still armed."""
        self.dlora_install()
        faults = self._dlora_switcher.faults
        if kind not in (_Faults.DROP, _Faults.DELAY, _Faults.RAISE):
            raise ValueError(f"unknown fault {kind!r}")
        faults.left[kind] = times
        return {k: n for k, n in faults.left.items() if n > 0}

    def dlora_pin_lora(self, lora_id: int) -> bool:
        """Pin a loaded adapter in the host (CPU) LoRA cache only, never evicted from it.

        vLLM's `pin_lora` also pins it in a device slot, which the scheduler does not count: with
        max_loras=2 and one pinned adapter, a step with two other adapters evicts one of them while
        activating the other and dies with a KeyError in `convert_mapping`.
        """
        # vLLM types `_adapter_manager` as LoRAModelManager; the model runner's LRU worker manager
        # always holds an LRUCacheLoRAModelManager, which has the method.
        manager = self.model_runner.lora_manager._adapter_manager
        manager._pin_lora_in_cpu_cache(lora_id)  # type: ignore[attr-defined]
        return True

    def dlora_prefetch_lora(self, name: str, lora_int_id: int, path: str) -> bool:
        """Start reading adapter `lora_int_id` in a background thread (`lora_prefetch.py`); the
        `add_lora` that follows then only inserts it. False if it is resident or already loading."""
        from vllm.lora.request import LoRARequest

        from dlora.engine_ext import lora_prefetch

        manager = self.model_runner.lora_manager
        if lora_int_id in manager.list_adapters():
            return False
        return lora_prefetch.install(manager).start(LoRARequest(name, lora_int_id, path))

    def dlora_prefetch_done(self, lora_int_id: int) -> bool:
        """True once no background read of adapter `lora_int_id` is running."""
        from dlora.engine_ext import lora_prefetch

        return lora_prefetch.install(self.model_runner.lora_manager).done(lora_int_id)

    def dlora_can_mix(self) -> bool:
        """True if this worker compensates a merged adapter, so other requests may share its steps."""
        self.dlora_install()
        return self._dlora_switcher.wrapper is not None

    def dlora_install(self) -> bool:
        """Install the model-runner hooks; idempotent. Returns True if it installed them now."""
        if getattr(self, "_dlora_switcher", None) is not None:
            return False
        self._dlora_switcher = _Switcher(self)
        self._dlora_switcher.install()
        return True

    def dlora_apply(self, op: str, adapter: str | None = None, path: str | None = None, lora_int_id: int = 0) -> dict:
        """Apply one switch command out of band (tests only: the scheduler does not learn of it;
        serving uses the in-band path)."""
        self.dlora_install()
        report = self._dlora_switcher.apply(SwitchCommand(op, adapter, path, lora_int_id))
        return {"op": report.op, "ok": report.ok, "seconds": report.seconds, "error": report.error}

    def dlora_prepare_merge(self, path: str) -> bool:
        """Cache an adapter's merged kernels while nothing is merged (`WeightMerger.prepare`), so
        its first in-band merge is a swap. Between engine steps (a utility call), so the weights the
        scheduler believes in are the weights in place before and after. False if skipped."""
        self.dlora_install()
        switcher = self._dlora_switcher
        if switcher.merged_adapter is not None:
            return False
        try:
            return switcher.merger().prepare(path)
        except MergeError as e:  # the base weights are in place; the adapter merges cold later
            log.warning("preparing the merged weights of %r failed: %s", path, e)
            return False

    def dlora_state(self) -> dict:
        s = getattr(self, "_dlora_switcher", None)
        if s is None:
            return {"installed": False}
        return {
            "installed": True,
            "merged_adapter": s.merged_adapter,
            "remap": sorted(s.remap),
            "mixing": s.wrapper is not None,
            "merged_slot": None if s.wrapper is None else s.wrapper._dlora_merged_slot,
            "applied": s.applied,
            "reloads": s._merger.reloads if s._merger else 0,
            "inplace_merges": s._merger.inplace_merges if s._merger else 0,
            "merge_strategy": s._merger.strategy if s._merger else None,
            "cached_merges": s._merger.cached_adapters if s._merger else [],
            "faults_armed": {k: n for k, n in s.faults.left.items() if n > 0},
        }
