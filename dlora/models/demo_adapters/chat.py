"""The base model through its chat template: loading it, greedy answers, and a training example
as the chat turn the server would render, scored on the answer only."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_NEW_TOKENS = 48
IGNORE = -100


def load_base(base_dir: Path, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).eval()
    return model, tok


def chat_prompt_ids(tok, question: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]


@torch.no_grad()
def generate(model, tok, questions: list[str], batch_size: int = 16, max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Greedy answers through the chat template, batched with left padding."""
    answers: list[str] = []
    for i in range(0, len(questions), batch_size):
        prompts = [chat_prompt_ids(tok, q) for q in questions[i : i + batch_size]]
        batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[:, batch["input_ids"].shape[1] :]
        answers += [tok.decode(row, skip_special_tokens=True).strip() for row in new]
    return answers


def encode_example(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat turn, and labels that score only the assistant's answer."""
    prompt = chat_prompt_ids(tok, question)
    full = tok.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert full[: len(prompt)] == prompt, "chat template must extend the generation prompt"
    end = full.index(tok.eos_token_id, len(prompt)) + 1  # answer + <|im_end|>, not the newline
    return full[:end], [IGNORE] * len(prompt) + full[len(prompt) : end]
