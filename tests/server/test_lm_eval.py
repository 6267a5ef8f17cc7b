"""lm-evaluation-harness as a client: its `local-completions` model against the tiny server scores the
same as its own `hf` model (HF transformers + PEFT, fp32) on the same task.

The task (tests/data/lm_eval) is a small question set in two forms: multiple choice, where lm-eval
sends one loglikelihood request per choice (the context and choice as token ids, `echo`, `logprobs: 1`,
one new token) and reads the prompt's logprobs back, and generate_until, greedy answers stopped at
the end of the line. Both go through lm-eval's own request building and response parsing, so what
is checked is what an evaluation team would see: per choice, the loglikelihood and lm-eval's
is_greedy flag; per question, the generated text.

The random tiny model's own greedy continuations are among the choices (the base model's for
questions 3 and 4, a2's for 1 and 2), so the is_greedy flags are not all false. a2 stands for the
adapters: it adapts the attention and the MLP layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # the shared `dlora serve` process

TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
CHOICE_TASK = "tiny_qa"
GENERATE_TASK = "tiny_qa_gen"
MODELS = ("tiny-base", "a2")
# fp32 on both sides: the served and HF logprobs differ only in summation order (see
# test_logprobs_oracle.py). The tiny model's logits are in the hundreds (its lm_head is initialised
# large, dlora/models/tiny.py), so a choice the model does not expect scores around -1,000 and fp32's
# ~7 significant digits leave an error relative to that size: over the base model, a1 and a2,
# measured at most 1.7e-3 at -1,321 (a1; 1.3e-6 relative) and 1.5e-4 near zero. A wrong adapter or
# scale moves these by whole units.
FP32_TOL = 1e-3
FP32_REL_TOL = 4e-6
# The tiny server's context length; lm-eval's default (2048) would not be truncated where the server would.
MAX_LENGTH = 512


def evaluate(model: str, model_args: str) -> dict[str, list[dict]]:
    """lm-eval's samples of both tasks, by task, in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[CHOICE_TASK, GENERATE_TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


class Runs:
    """Each model's lm-eval samples, served and from HF, computed once for the module's tests."""

    def __init__(self, server_url: str, tiny_model) -> None:
        self.server_url = server_url
        self.tiny_model = tiny_model
        self._cache: dict[tuple[str, str], dict[str, list[dict]]] = {}

    def served(self, model: str) -> dict[str, list[dict]]:
        # add_bos_token: HF's tokenizer starts every sequence with <s>; the served requests must too.
        args = (
            f"model={model},base_url={self.server_url}/v1/completions,tokenizer={self.tiny_model.base},"
            f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length={MAX_LENGTH},"
            "add_bos_token=True"
        )
        return self._run("local-completions", model, args)

    def reference(self, model: str) -> dict[str, list[dict]]:
        import torch

        # One thread, as tests/oracle.py: torch's default pool contends with the server's replica for
        # the shared cores and made these runs about 7 times slower.
        torch.set_num_threads(1)
        args = f"pretrained={self.tiny_model.base},dtype=float32,device=cpu,batch_size=1,add_bos_token=True"
        if model in self.tiny_model.adapters:
            args += f",peft={self.tiny_model.adapters[model]}"
        return self._run("hf", model, args)

    def _run(self, kind: str, model: str, args: str) -> dict[str, list[dict]]:
        if (kind, model) not in self._cache:
            self._cache[kind, model] = evaluate(kind, args)
        return self._cache[kind, model]


@pytest.fixture(scope="module")
def runs(tiny_server, tiny_model) -> Runs:
    return Runs(tiny_server.url, tiny_model)


@pytest.mark.parametrize("model", MODELS)
def test_choice_loglikelihoods_match_hf(runs, tiny_server, model):
    served, want = runs.served(model)[CHOICE_TASK], runs.reference(model)[CHOICE_TASK]
    assert [s["arguments"] for s in served] == [s["arguments"] for s in want]  # the same requests
    greedy = 0
    for got_doc, want_doc in zip(served, want, strict=True):
        for choice, (got, hf) in enumerate(zip(got_doc["resps"], want_doc["resps"], strict=True)):
            (got_ll, got_greedy), (hf_ll, hf_greedy) = got[0], hf[0]
            where = (got_doc["doc_id"], choice)
            assert abs(got_ll - hf_ll) <= FP32_TOL + FP32_REL_TOL * abs(hf_ll), (where, got_ll, hf_ll)
            assert got_greedy == hf_greedy, (where, got_greedy, hf_greedy)
            greedy += hf_greedy
    assert greedy >= 1, "no choice is the model's greedy continuation: the flags were not compared on a true one"


@pytest.mark.parametrize("model", MODELS)
def test_generate_until_matches_hf(runs, tiny_server, model):
    served, want = runs.served(model)[GENERATE_TASK], runs.reference(model)[GENERATE_TASK]
    got_texts = [s["resps"][0][0] for s in served]
    want_texts = [s["resps"][0][0] for s in want]
    assert got_texts == want_texts
    assert all(want_texts), "an empty greedy answer would make the comparison weak"
