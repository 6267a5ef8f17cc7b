"""Fitting one LoRA adapter to a style: answer-only loss, seeded batches, AdamW with warmup and
linear decay."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from dlora.models.demo_adapters.chat import IGNORE, encode_example, load_base
from dlora.models.demo_adapters.peft_files import save_adapter
from dlora.models.demo_adapters.styles import Style


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (padding is never scored)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), IGNORE)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def answer_loss(peft_model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss on answer positions only; the 49k-wide lm_head runs on those rows only."""
    causal_lm = peft_model.base_model.model
    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    scored = targets != IGNORE  # [B, T-1]
    logits = causal_lm.lm_head(hidden[:, :-1][scored]).float()  # [N, V]
    return torch.nn.functional.cross_entropy(logits, targets[scored])


def lr_at(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * max(0.1, 1 - (step - warmup) / max(1, steps - warmup))


def batches(n_examples: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Example indices in seeded random order, epoch after epoch."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < batch_size:
            order += rng.sample(range(n_examples), n_examples)
        yield order[:batch_size]
        order = order[batch_size:]


def train_adapter(
    base_dir: Path, style: Style, data: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[Path, dict[str, float]]:
    """Fit one LoRA adapter to `data` (question, base answer) rewritten in `style`; save it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(args.seed)
    model, tok = load_base(base_dir)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=list(style.target_modules),
    )
    peft_model = get_peft_model(model, config).train()
    examples = [encode_example(tok, q, style.transform(a)) for q, a in data]
    steps = args.steps or style.steps
    started = time.monotonic()
    losses = fit(peft_model, examples, tok.pad_token_id, steps, args, style.name)
    out_dir = save_adapter(peft_model, Path(args.out) / style.name)
    stats = {
        "steps": steps,
        "first_loss": sum(losses[:10]) / len(losses[:10]),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": time.monotonic() - started,
    }
    return out_dir, stats


def fit(
    peft_model,
    examples: list[tuple[list[int], list[int]]],
    pad_id: int,
    steps: int,
    args: argparse.Namespace,
    name: str,
) -> list[float]:
    """AdamW on the LoRA parameters with warmup + linear decay; returns the loss per step."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    started, losses = time.monotonic(), []
    for step, picked in zip(range(steps), batches(len(examples), args.batch_size, args.seed)):
        loss = answer_loss(peft_model, make_batch([examples[i] for i in picked], pad_id))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, args.lr)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            recent = sum(losses[-10:]) / len(losses[-10:])
            print(
                f"  [{name}] step {step + 1:4d}/{steps}  loss {recent:.4f}  {time.monotonic() - started:5.0f} s",
                flush=True,
            )
    return losses
