"""Every implemented sampling field, through a real server, against an oracle on the same prompts.

Fields whose effect is exact whatever the logit margins (stop_token_ids, echo, min_tokens, top_k=1,
min_p=1) run on the shared tiny server and its HF oracle. Fields whose effect is a few logits
(presence/frequency/repetition penalties, EOS suppression by min_tokens) and chat logprobs run on
the shipped SmolLM2 config in fp32, where margins are realistic: there an error of one penalty
unit changes the answer. Those are checked on the served path (tests/oracle.py, teacher-forced):
HF's logits for every served step, penalized by hand as vLLM penalizes them, must make the served
token the argmax, up to an fp32 near-tie.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.oracle import greedy_choice_errors, top_k_errors

pytestmark = pytest.mark.engine  # a `dlora serve` process

TINY_PROMPTS = ["def main(", "import os\nimport sys\n"]
TINY_MAX_TOKENS = 12
FP32_TOL = 1e-3  # fp32 vs fp32 logprobs (see test_logprobs_oracle.py for the derivation)
FP32_TIE = 1e-2  # a top-2 logit gap below this is a tie for fp32


def post(url: str, path: str, **body) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def complete(url: str, **body) -> dict:
    body = {"temperature": 0, "max_tokens": TINY_MAX_TOKENS, "return_token_ids": True} | body
    return post(url, "/v1/completions", **body)["choices"][0]


# --- tiny server: fields with an exact effect ------------------------------------------------------


def first_new_token(ids: list[int], start: int) -> int:
    """The first position from `start` whose token did not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def tiny_greedy_masked(
    oracle, adapter, prompt_ids, max_tokens, masked: set[int], min_tokens: int, stop_ids: set[int]
) -> list[int]:
    """HF greedy with `masked` ids impossible for the first `min_tokens` steps, ending at a stop id."""
    import torch

    model, ids, out = oracle._load(adapter), list(prompt_ids), []
    with torch.no_grad():
        for step in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            if step < min_tokens:
                logits[list(masked)] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in stop_ids:
                break
    return out


@pytest.mark.parametrize("model", ["tiny-base", "a2"])
def test_stop_token_ids_end_at_the_first_such_id(tiny_server, oracle, model):
    adapter = None if model == "tiny-base" else model
    for prompt in TINY_PROMPTS:
        ids = oracle.tokenizer()(prompt)["input_ids"]
        full = oracle.greedy(adapter, ids, TINY_MAX_TOKENS)
        at = first_new_token(full, 3)
        choice = complete(tiny_server.url, model=model, prompt=prompt, stop_token_ids=[full[at], 5])
        assert choice["token_ids"] == full[: at + 1]  # the stop id is the last token, as EOS would be
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == full[at]
        assert choice["text"] == oracle.tokenizer().decode(full[:at])  # its text is not part of the answer


def test_min_tokens_suppresses_stop_ids_until_reached(tiny_server, oracle):
    """vLLM masks EOS and stop_token_ids until min_tokens: the stop id chosen from step 1 of the
    greedy answer must not appear before step 6, and the answer goes where HF's does with it masked."""
    ids = oracle.tokenizer()(TINY_PROMPTS[0])["input_ids"]
    full = oracle.greedy(None, ids, TINY_MAX_TOKENS)
    stop = full[1]
    min_tokens = 6
    want = tiny_greedy_masked(
        oracle, None, ids, TINY_MAX_TOKENS, {stop, oracle.tokenizer().eos_token_id}, min_tokens, {stop}
    )
    assert want[:2] != full[:2]  # masking changed the answer, so the comparison below means something
    choice = complete(tiny_server.url, model="tiny-base", prompt=ids, stop_token_ids=[stop], min_tokens=min_tokens)
    assert choice["token_ids"] == want
    assert stop not in choice["token_ids"][:min_tokens]
    if want[-1] == stop:
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    else:
        assert choice["finish_reason"] == "length"


def tiny_greedy_with(oracle, adapter, prompt_ids, max_tokens, shape) -> list[int]:
    """HF greedy where `shape(logits)` (in place) acts on each step's logits, as vLLM's logit
    processing does before it samples."""
    import torch

    model, ids, out = oracle._load(adapter), list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            shape(logits)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
    return out


def test_logit_bias_and_allowed_token_ids_steer_greedy_as_in_hf(tiny_server, oracle):
    """logit_bias adds to the named logits; allowed_token_ids leaves only those ids. Both hold on
    every step of an adapter's answer, as HF's greedy with the same logits."""
    ids = oracle.tokenizer()(TINY_PROMPTS[0])["input_ids"]
    full = oracle.greedy("a1", ids, TINY_MAX_TOKENS)
    at = first_new_token(full, 1)
    bias = {full[0]: -30.0, full[at]: 3.0}

    def biased(logits):
        for token, b in bias.items():
            logits[token] += b

    want = tiny_greedy_with(oracle, "a1", ids, TINY_MAX_TOKENS, biased)
    assert want != full  # the bias changed the answer, so the comparison means something
    body = {"model": "a1", "prompt": ids, "ignore_eos": True}
    choice = complete(tiny_server.url, **body, logit_bias={str(t): b for t, b in bias.items()})
    assert choice["token_ids"] == want

    allowed = sorted({full[1], full[at], 11, 42})

    def only_allowed(logits):
        keep = logits[allowed].clone()
        logits.fill_(float("-inf"))
        logits[allowed] = keep

    want = tiny_greedy_with(oracle, "a1", ids, TINY_MAX_TOKENS, only_allowed)
    choice = complete(tiny_server.url, **body, allowed_token_ids=allowed)
    assert choice["token_ids"] == want and set(choice["token_ids"]) <= set(allowed)


def test_bad_words_are_never_generated(tiny_server, oracle):
    """vLLM bans a bad word's tokens, written with and without a leading space: the greedy answer's
    first word, banned, appears in neither form."""
    tok = oracle.tokenizer()
    ids = tok(TINY_PROMPTS[1])["input_ids"]
    full = oracle.greedy("a0", ids, TINY_MAX_TOKENS)
    word = next(w for w in (tok.decode(full[: i + 1]).strip() for i in range(len(full))) if w)
    banned = [tok(w, add_special_tokens=False)["input_ids"] for w in (word, " " + word)]
    out = complete(tiny_server.url, model="a0", prompt=ids, bad_words=[word], ignore_eos=True)["token_ids"]
    assert out != full
    for seq in banned:
        assert not any(out[i : i + len(seq)] == seq for i in range(len(out))), (word, seq, out)


@pytest.mark.parametrize("field", [{"top_k": 1}, {"min_p": 1.0}], ids=["top_k=1", "min_p=1"])
def test_single_candidate_sampling_equals_greedy(tiny_server, oracle, field):
    """top_k=1 and min_p=1 leave only the argmax, whatever the temperature or seed."""
    for model, prompt in [("tiny-base", TINY_PROMPTS[0]), ("a1", TINY_PROMPTS[1])]:
        adapter = None if model == "tiny-base" else model
        ids = oracle.tokenizer()(prompt)["input_ids"]
        for seed in (0, 7):
            choice = complete(tiny_server.url, model=model, prompt=prompt, temperature=1.5, seed=seed, **field)
            assert choice["token_ids"] == oracle.greedy(adapter, ids, TINY_MAX_TOKENS), (model, seed)


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_echo_prefixes_each_prompt_text(tiny_server, oracle, as_ids):
    """Each choice of a two-prompt request starts with its own prompt, given as text or as ids."""
    tok = oracle.tokenizer()
    prompts = list(TINY_PROMPTS)
    if as_ids:
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in TINY_PROMPTS]
        # Ids without special tokens have one text, so the echo has one right answer.
        assert [tok.decode(ids) for ids in prompts] == list(TINY_PROMPTS)
    body = {"model": "a0", "prompt": prompts, "temperature": 0, "max_tokens": TINY_MAX_TOKENS}
    plain = post(tiny_server.url, "/v1/completions", **body)["choices"]
    echoed = post(tiny_server.url, "/v1/completions", **body, echo=True)["choices"]
    assert [c["index"] for c in echoed] == [0, 1]
    for text, p, e in zip(TINY_PROMPTS, plain, echoed):
        assert p["text"] and not p["text"].startswith(text)
        assert e["text"] == text + p["text"]


def test_echo_in_a_stream_comes_once_before_the_answer(tiny_server):
    body = {"model": "a0", "prompt": TINY_PROMPTS[0], "temperature": 0, "max_tokens": TINY_MAX_TOKENS}
    whole = post(tiny_server.url, "/v1/completions", **body, echo=True)["choices"][0]["text"]
    texts = []
    with httpx.stream(
        "POST", f"{tiny_server.url}/v1/completions", json=body | {"echo": True, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[len("data: ") :])["choices"][0]["text"])
    assert texts[0].startswith(TINY_PROMPTS[0])
    assert "".join(texts) == whole


# --- shipped SmolLM2, fp32: fields whose effect is a few logits -----------------------------------

PENALTY_PROMPTS = (
    "List the days of the week.",
    "Write a short poem about the sea.",
)
PENALTY_MAX_TOKENS = 40
PENALTIES = {
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 1.0},
    "repetition": {"repetition_penalty": 1.3},
    "all": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "negative": {"presence_penalty": -1.0, "frequency_penalty": -0.3},
}


def penalized(
    logits,
    prompt_ids: list[int],
    output_ids: list[int],
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
):
    """The logits vLLM samples each output step from (vllm/model_executor/layers/utils.py,
    apply_penalties): the repetition penalty on every token seen in the prompt or the output so
    far (positive logits divided, others multiplied, as HF's RepetitionPenaltyLogitsProcessor), then
    OpenAI's frequency and presence penalties on output tokens only: - f * count - p * (count > 0)."""
    import torch

    out = logits.clone()
    vocab = out.shape[-1]
    for step in range(len(output_ids)):
        row = out[step]
        counts = torch.bincount(torch.tensor(output_ids[:step], dtype=torch.long), minlength=vocab).float()
        seen = counts > 0
        seen[torch.tensor(prompt_ids)] = True
        row[seen] = torch.where(row[seen] > 0, row[seen] / repetition_penalty, row[seen] * repetition_penalty)
        row -= frequency_penalty * counts + presence_penalty * (counts > 0).float()
    return out


@pytest.fixture(scope="module")
def unpenalized(shipped_server, shipped_oracle) -> dict[str, list[int]]:
    """The greedy answer to each penalty prompt without penalties, asked once for all penalties."""
    return {
        prompt: complete(shipped_server.url, **penalty_body(shipped_oracle, prompt))["token_ids"]
        for prompt in PENALTY_PROMPTS
    }


def penalty_body(oracle, prompt: str) -> dict:
    return {"model": oracle.served_name, "prompt": oracle.chat_ids(prompt), "max_tokens": PENALTY_MAX_TOKENS}


@pytest.mark.parametrize("penalty", list(PENALTIES))
def test_penalties_match_the_reference(shipped_server, shipped_oracle, unpenalized, penalty):
    fields = PENALTIES[penalty]
    changed = False
    for prompt in PENALTY_PROMPTS:
        body = penalty_body(shipped_oracle, prompt)
        ids, plain = body["prompt"], unpenalized[prompt]
        got = complete(shipped_server.url, **body, **fields)["token_ids"]
        logits = shipped_oracle.logits(None, ids, got)
        assert greedy_choice_errors(penalized(logits, ids, got, **fields), got, FP32_TIE) == [], (prompt, got)
        if got != plain:
            changed = True
            # The reference tells the two apart: the unpenalized answer breaks it somewhere.
            plain_logits = shipped_oracle.logits(None, ids, plain)
            assert greedy_choice_errors(penalized(plain_logits, ids, plain, **fields), plain, FP32_TIE) != []
    assert changed, f"{fields} changed no answer: the comparison shows nothing"


def test_min_tokens_suppresses_eos(shipped_server, shipped_oracle):
    """A short answer ends with EOS well before 20 tokens; with min_tokens=20 it must not, and each
    step is HF's greedy choice with EOS masked (a tie aside) until then."""
    eos = shipped_oracle.tokenizer().eos_token_id
    ids = shipped_oracle.chat_ids("What is the capital of France?")
    body = {"model": shipped_oracle.served_name, "prompt": ids, "max_tokens": 30}
    short = complete(shipped_server.url, **body)
    assert short["finish_reason"] == "stop" and len(short["token_ids"]) < 20, short
    min_tokens = 20
    got = complete(shipped_server.url, **body, min_tokens=min_tokens)
    assert len(got["token_ids"]) >= min_tokens and eos not in got["token_ids"][:min_tokens]
    logits = shipped_oracle.logits(None, ids, got["token_ids"])
    logits[:min_tokens, eos] = float("-inf")
    assert greedy_choice_errors(logits, got["token_ids"], FP32_TIE) == []


@pytest.mark.parametrize("model", [None, "pirate"], ids=["base", "pirate"])
def test_chat_logprobs_equal_hf_log_softmax(shipped_server, shipped_oracle, model):
    tok = shipped_oracle.tokenizer()
    question = "How do I boil an egg?"
    resp = post(
        shipped_server.url,
        "/v1/chat/completions",
        model=model or shipped_oracle.served_name,
        messages=[{"role": "user", "content": question}],
        temperature=0,
        max_tokens=20,
        logprobs=True,
        top_logprobs=5,
        return_token_ids=True,
    )
    prompt_ids, choice = resp["prompt_token_ids"], resp["choices"][0]
    assert prompt_ids == shipped_oracle.chat_ids(question)
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(content) == len(ids) == 20
    hf_lp = shipped_oracle.logits(model, prompt_ids, ids).log_softmax(-1)
    assert greedy_choice_errors(hf_lp, ids, FP32_TIE) == []
    for step, (token, entry) in enumerate(zip(ids, content)):
        assert entry["token"] == tok.decode([token]) and entry["bytes"] == list(entry["token"].encode())
        assert abs(entry["logprob"] - float(hf_lp[step, token])) <= FP32_TOL, (step, entry)
        top = entry["top_logprobs"]
        assert len(top) == 5 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        errors, _ = top_k_errors(tok, hf_lp[step], {t["token"]: t["logprob"] for t in top}, 5, FP32_TOL)
        assert errors == [], (step, errors)


@pytest.mark.parametrize("model", ["tiny-base", "a2"])
def test_echo_with_logprobs_scores_the_prompt_as_hf(tiny_server, oracle, model):
    """lm-eval's loglikelihood request (echo, logprobs, one new token): every prompt token after the
    first carries its log-probability under the model, as HF's log-softmax over the same prefix."""
    import torch

    adapter = None if model == "tiny-base" else model
    ids = oracle.tokenizer()(TINY_PROMPTS[1])["input_ids"]
    body = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    lp = post(tiny_server.url, "/v1/completions", **body)["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    with torch.no_grad():
        logits = oracle._load(adapter)(torch.tensor([ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    got = lp["token_logprobs"][1 : len(ids)]
    assert max(abs(g - w) for g, w in zip(got, want)) < FP32_TOL, (got, want)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])  # the prompt's own token, at least
