"""The merge state is never wrong silently.

1. The worker's switch reports reach the scheduler through whichever output vLLM's model runner
   returns: a plain ModelRunnerOutput, or an AsyncModelRunnerOutput (vLLM's V2 runner, the default
   on CUDA), which the executors resolve with `get_output()` before the scheduler sees it. Checked
   with vLLM's real classes: the V2 `AsyncOutput`, `UniProcExecutor`, `WorkerProc.enqueue_output`.
2. When the reports do not say for sure which weights the worker holds, the scheduler runs nothing
   until the base weights are restored and confirmed (`weight_state.py`, pure logic below).
3. Faults injected into a real in-process engine (tiny model, fp32, the `merged` policy switching
   models every step): a dropped report, a report a step late, a merge that raises. A mixed
   workload (base + 2 adapters) still equals HF + PEFT, no request runs while the weights are
   unknown, and KV blocks computed on unknown weights are never reused.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dlora.engine_ext.inband import MERGE, REPORTS_ATTR, UNMERGE, SwitchCommand, SwitchReport
from dlora.engine_ext.weight_state import UNKNOWN, Restore, WeightsUnknown, split_reports, weights_after
from tests.engine_ext.test_switching_engine import PROMPTS, lora, record_steps

# ---- 1. reports through vLLM's output wrappers ------------------------------------------------


class _HostEvent:
    """Stands in for the CUDA event the V2 runner records after its device-to-host copies: the
    arrays below are host memory already, so there is nothing to wait for."""

    def synchronize(self) -> None:
        pass


def _inner_output(req_ids):
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)})


def _v2_async_output(tokens: dict[str, int]):
    """vLLM's V2 `AsyncOutput` as its __init__ leaves it once the sampled tokens are on the host
    (the __init__ itself needs CUDA streams)."""
    from vllm.v1.worker.gpu.async_utils import AsyncOutput

    out = AsyncOutput.__new__(AsyncOutput)
    out.model_runner_output = _inner_output(tokens)
    out.sampler_output = out.num_sampled_tokens = out.pending_aux_output = None
    out.copy_event = _HostEvent()
    out._has_fault = None
    out.sampled_token_ids = np.array([[t, -1] for t in tokens.values()], dtype=np.int64)
    out.num_sampled_tokens_np = np.ones(len(tokens), dtype=np.int32)
    out.logprobs_tensors = out.num_nans = out.sampling_mask_tensors = None
    out.prompt_logprobs_dict, out.prompt_token_id_logprobs_dict = {}, {}
    return out


class _Runner:
    """The step protocol of a vLLM model runner: `execute_model` returns the step's output, or None
    and then `sample_tokens` returns it (V2 always splits)."""

    def __init__(self, make_output, split: bool) -> None:
        self.make_output, self.split = make_output, split

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return None if self.split else self.make_output()

    def sample_tokens(self, grammar_output):
        return self.make_output()

    def _set_active_loras(self, *args):
        pass


def _worker(runner):
    """dlora's real worker hooks on `runner`, behind vLLM's Worker calling convention."""
    from dlora.engine_ext.worker import _Switcher

    switcher = _Switcher(SimpleNamespace(model_runner=runner))
    switcher.install()
    return SimpleNamespace(
        execute_model=lambda so: runner.execute_model(so, None), sample_tokens=lambda g: runner.sample_tokens(g)
    )


def _scheduler_output():
    return SimpleNamespace(dlora_cmds=[SwitchCommand(UNMERGE, seq=7)], total_num_scheduled_tokens=1)


def _engine_core_step(executor, scheduler_output):
    """What vLLM's `EngineCore.step` does with the executor (core.py)."""
    out = executor.execute_model(scheduler_output, non_block=True).result()
    return executor.sample_tokens(None) if out is None else out


def _uniproc(driver_worker):
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    executor = UniProcExecutor.__new__(UniProcExecutor)
    executor.driver_worker = driver_worker
    return executor


def _assert_reported(output, tokens):
    (report,) = getattr(output, REPORTS_ATTR)
    assert (report.op, report.ok, report.seq) == (UNMERGE, True, 7)
    assert output.sampled_token_ids == [[t] for t in tokens.values()]


@pytest.mark.parametrize("split", [True, False], ids=["sample_tokens", "execute_model"])
def test_reports_survive_vllms_v2_async_output_in_the_uniproc_executor(split):
    tokens = {"r0": 11, "r1": 22}
    executor = _uniproc(_worker(_Runner(lambda: _v2_async_output(tokens), split)))
    _assert_reported(_engine_core_step(executor, _scheduler_output()), tokens)


def test_reports_survive_vllms_v2_async_output_in_the_multiproc_worker():
    from vllm.v1.executor.multiproc_executor import WorkerProc

    tokens = {"r0": 5}
    worker = _worker(_Runner(lambda: _v2_async_output(tokens), True))
    assert worker.execute_model(_scheduler_output()) is None
    sent = []
    proc = SimpleNamespace(worker_response_mq=SimpleNamespace(enqueue=sent.append))
    WorkerProc.enqueue_output(proc, worker.sample_tokens(None))  # what the worker process sends back
    ((status, output),) = sent
    assert status == WorkerProc.ResponseStatus.SUCCESS
    _assert_reported(output, tokens)


def test_reports_on_a_plain_output_leave_vllms_shared_empty_output_alone():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    executor = _uniproc(_worker(_Runner(lambda: EMPTY_MODEL_RUNNER_OUTPUT, False)))
    out = _engine_core_step(executor, _scheduler_output())
    assert getattr(out, REPORTS_ATTR)[0].seq == 7
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, REPORTS_ATTR)


def test_replicas_run_vllms_v1_model_runner():
    from dlora import config
    from dlora.replica.ray_replica import replica_runtime_env

    env = replica_runtime_env(config.from_dict({}))["env_vars"]
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"


# ---- 2. the weight state the reports allow (pure) -------------------------------------------


def _report(cmd: SwitchCommand, ok=True, known=True) -> SwitchReport:
    return SwitchReport(cmd.op, cmd.adapter, ok, 0.01, None, cmd.seq, known)


def test_only_complete_sure_reports_of_the_steps_own_commands_settle_its_weights():
    unmerge, merge = SwitchCommand(UNMERGE, "a0", seq=4), SwitchCommand(MERGE, "a1", "/a1", 2, seq=5)
    cmds = [unmerge, merge]
    assert weights_after([], [], "a0") == "a0"
    assert weights_after(cmds, [_report(unmerge), _report(merge)], "a1") == "a1"
    assert weights_after(cmds, [_report(unmerge), _report(merge, ok=False)], "a1") is None  # MergeError
    assert weights_after(cmds, [_report(unmerge)], "a1") is UNKNOWN  # one dropped
    assert weights_after(cmds, [], "a1") is UNKNOWN
    assert weights_after(cmds, [_report(unmerge), _report(merge, ok=False, known=False)], "a1") is UNKNOWN
    late = _report(SwitchCommand(MERGE, "a0", "/a0", 1, seq=3))
    mine, other = split_reports(cmds, [late, _report(unmerge)])
    assert (mine, other) == ([_report(unmerge)], [late])
    assert weights_after(cmds, mine, "a1") is UNKNOWN  # a late report never stands in for this step's


def test_restore_waits_a_step_resends_and_gives_up():
    seqs = iter(range(10, 20))
    restore = Restore(max_attempts=2, wait_steps=1)
    first = restore.command(lambda: next(seqs))
    assert (first.op, first.seq) == (UNMERGE, 10)
    assert not restore.settle([])
    assert restore.command(lambda: next(seqs)) is None  # its report may come a step late
    assert not restore.settle([_report(SwitchCommand(MERGE, "a0", seq=9))])  # an older report
    second = restore.command(lambda: next(seqs))
    assert second.seq == 11
    assert not restore.settle([_report(first)])  # only the last restore counts
    assert restore.command(lambda: next(seqs)) is None
    with pytest.raises(WeightsUnknown):
        restore.command(lambda: next(seqs))


def test_restore_is_confirmed_only_by_its_sure_success():
    restore = Restore()
    cmd = restore.command(lambda: 1)
    assert not restore.settle([_report(cmd, ok=False, known=False)])
    again = restore.command(lambda: 2)  # a failed restore is resent at once, not waited for
    assert again.seq == 2
    assert restore.settle([_report(again)])


# ---- 3. faults in a real engine ---------------------------------------------------------------

JOBS = [(a, p) for p in PROMPTS[:2] for a in (None, "a0", "a1")]
MAX_TOKENS = 10


@pytest.fixture
def llm(merged_switching_engine):
    """vLLM's LoRA ops, no mixing; the `merged` policy switching every step (tests/engine_ext/conftest.py)."""
    return merged_switching_engine.llm


@pytest.fixture
def scheduler(llm):
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    sched._dlora_worker.blocked.clear()  # an adapter whose merge failed in an earlier test may merge again
    yield sched
    for kind in ("drop_reports", "delay_reports", "raise_after_merge"):  # a failed test's leftovers
        llm.collective_rpc("dlora_inject_fault", args=(kind, 0))
    assert not sched.dlora_batching_state().weights_unknown


def _generate(llm, tiny_model, jobs, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(
        [p for _, p in jobs], params, lora_request=[lora(tiny_model, a) if a else None for a, _ in jobs], use_tqdm=False
    )


@pytest.mark.engine
@pytest.mark.parametrize("fault,times", [("drop_reports", 2), ("delay_reports", 1), ("raise_after_merge", 1)])
def test_mixed_workload_equals_hf_peft_under_faults(llm, scheduler, tiny_model, oracle, fault, times):
    restores = scheduler.dlora_batching_state().weight_restores
    assert llm.collective_rpc("dlora_inject_fault", args=(fault, times)) == [{fault: times}]
    steps, unwrap = record_steps(scheduler)
    try:
        outs = _generate(llm, tiny_model, JOBS)
    finally:
        unwrap()
    tok = oracle.tokenizer()
    for (adapter, prompt), o in zip(JOBS, outs):
        assert list(o.outputs[0].token_ids) == oracle.greedy(adapter, tok(prompt)["input_ids"], MAX_TOKENS), adapter
    (worker,) = llm.collective_rpc("dlora_state")
    assert worker["faults_armed"] == {}  # every fault fired
    # The scheduler restored the base weights after the fault, and ran nothing meanwhile.
    assert scheduler.dlora_batching_state().weight_restores > restores
    unknown = [ran for w, ran, _ in steps if w is UNKNOWN]
    assert unknown and not any(unknown)
    # Only the merged adapter's requests ever ran on merged weights; switching went on after.
    assert all(ran <= {w} for w, ran, _ in steps if isinstance(w, str))
    last_unknown = max(i for i, (w, *_) in enumerate(steps) if w is UNKNOWN)
    assert any(cmd for *_, cmd in steps[last_unknown + 1 :])


@pytest.mark.engine
def test_blocks_computed_on_unknown_weights_are_never_reused(llm, scheduler, tiny_model):
    """A prompt first computed in the step whose report was dropped: its cached blocks serve no
    later request, unmerged or merged; recomputed, they do."""
    from dlora.scheduling import make_policy

    prompt = "".join(f"unknown_state_{i} = check({i}, {i * 3})\n" for i in range(20))  # ~340 tokens
    jobs = [("a0", prompt)]
    policy = scheduler.batching_policy
    try:
        llm.collective_rpc("dlora_inject_fault", args=("drop_reports", 1))
        steps, unwrap = record_steps(scheduler)
        try:
            (first,) = _generate(llm, tiny_model, jobs, max_tokens=2)
        finally:
            unwrap()
        # The prompt was computed in a switching step whose report was lost.
        assert first.num_cached_tokens == 0 and steps[0][1:] == ({"a0"}, True)
        block = scheduler.block_size
        reusable = (len(first.prompt_token_ids) - 1) // block * block
        assert reusable >= 2 * block
        scheduler.batching_policy = make_policy("unmerged")
        assert _generate(llm, tiny_model, jobs, max_tokens=2)[0].num_cached_tokens == 0
        assert _generate(llm, tiny_model, jobs, max_tokens=2)[0].num_cached_tokens == reusable
        assert steps[1][0] is UNKNOWN  # and the base weights were restored right after it
    finally:
        scheduler.batching_policy = policy
