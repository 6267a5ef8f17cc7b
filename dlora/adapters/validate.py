"""Validate a PEFT LoRA adapter against the base model before anyone may use it.

A request that names a bad adapter path kills the whole vLLM engine (every in-flight request
fails), so nothing reaches an engine until this module has read the adapter's config and every
tensor header and checked them against the base model's shapes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# vLLM scales the LoRA term by lora_alpha / r. PEFT adapters use alpha of about r to 2r, and dlora's
# largest max_lora_rank is 512; 4096 (8x that) leaves room for any sane choice, while a larger
# scale only amplifies the adapter's term past what fp16/bf16 activations hold (fp16 tops out at
# 65504), i.e. a value that is a mistake or an attack, not a fine-tune.
MAX_LORA_ALPHA = 4096.0
# Pickled weights (torch.load) can run arbitrary code when vLLM loads them.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Projections of a Llama-style decoder layer that vLLM can wrap with LoRA.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterValidationError(ValueError):
    """The adapter cannot be served. The message says why in words a client may see: it names no
    server path and quotes no error text that could; `detail` carries that for the server log."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail

    def described(self) -> str:
        """The message and its detail, for the server log."""
        return f"{self}: {self.detail}" if self.detail else str(self)


@dataclass(frozen=True)
class BaseModelShapes:
    """The (in, out) feature sizes of every LoRA-able projection, read from config.json."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> BaseModelShapes:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        inter = cfg["intermediate_size"]
        shapes = {
            "q_proj": (hidden, heads * head_dim),
            "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim),
            "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(num_layers=cfg["num_hidden_layers"], shapes=shapes)

    def lora_fraction(self, rank: int, modules: Sequence[str]) -> float:
        """Multiply-adds per token in a rank-`rank` adapter on `modules` (A: in x r, B: r x out),
        over those in a layer's seven base projections: 0.009 for rank 8 on q/k/v/o of
        SmolLM2-135M, 0.18 for rank 64 on all seven. Unknown module names count for nothing."""
        lora = sum(rank * sum(self.shapes[m]) for m in set(modules) if m in self.shapes)
        return lora / sum(i * o for i, o in self.shapes.values())


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    size_bytes: int


def _read_config(d: Path) -> dict:
    f = d / CONFIG_FILE
    if not f.is_file():
        raise AdapterValidationError(f"{CONFIG_FILE} not found in the adapter directory", f"{str(d)!r}")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterValidationError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterValidationError(f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def _check_config(cfg: dict, max_rank: int) -> tuple[int, float]:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterValidationError(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise AdapterValidationError("DoRA adapters (use_dora=true) are not supported")
    if cfg.get("modules_to_save"):
        raise AdapterValidationError(f"modules_to_save {cfg['modules_to_save']!r} is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterValidationError("per-module rank_pattern/alpha_pattern is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterValidationError(f"rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise AdapterValidationError(f"rank {rank} exceeds the configured max_lora_rank {max_rank}")
    return rank, _check_alpha(cfg.get("lora_alpha", rank))


def _check_alpha(alpha) -> float:
    # json.loads accepts NaN and Infinity, and 1e999 parses as inf: all reach here as floats.
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterValidationError(f"lora_alpha={alpha!r} must be a number")
    value = float(alpha)
    if not math.isfinite(value) or not 0 < value <= MAX_LORA_ALPHA:
        raise AdapterValidationError(f"lora_alpha={alpha!r} must be finite, > 0 and <= {MAX_LORA_ALPHA:g}")
    return value


def _check_tensors(weights: Path, rank: int, base: BaseModelShapes) -> tuple[str, ...]:
    seen: dict[tuple[int, str], set[str]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                layer, module, which = _parse_key(key, base)
                shape = tuple(f.get_slice(key).get_shape())
                _check_shape(key, shape, which, rank, base.shapes[module])
                seen.setdefault((layer, module), set()).add(which)
                # Reads the data (a truncated file fails here, not in the engine), one tensor at a
                # time. A NaN/Inf weight would poison every token of a batch that packs it.
                if not bool(f.get_tensor(key).isfinite().all()):
                    raise AdapterValidationError(f"tensor {key!r} holds NaN or infinite values")
    except AdapterValidationError:
        raise
    except SafetensorError as e:  # the format's own words about the file's bytes
        raise AdapterValidationError(f"{WEIGHTS_FILE} is not a readable safetensors file: {e}") from None
    except Exception as e:  # other types (an OSError naming the file, torch's errors) stay in the log
        raise AdapterValidationError(
            f"{WEIGHTS_FILE} is not a readable safetensors file", f"{type(e).__name__}: {e}"
        ) from None
    if not seen:
        raise AdapterValidationError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    for (layer, module), parts in seen.items():
        if parts != {"A", "B"}:
            raise AdapterValidationError(f"layer {layer} {module} has lora_{parts.pop()} without its pair")
    return tuple(m for m in SUPPORTED_MODULES if any(mod == m for _, mod in seen))


def _parse_key(key: str, base: BaseModelShapes) -> tuple[int, str, str]:
    m = _KEY.search(key)
    if not m:
        raise AdapterValidationError(f"tensor {key!r} is not a LoRA weight of a supported projection")
    layer, module, which = int(m.group(1)), m.group(2), m.group(3)
    if module not in base.shapes:
        raise AdapterValidationError(f"tensor {key!r} targets {module!r}; supported: {list(SUPPORTED_MODULES)}")
    if layer >= base.num_layers:
        raise AdapterValidationError(f"tensor {key!r} names layer {layer}; the base model has {base.num_layers}")
    return layer, module, which


def _check_shape(key: str, shape: tuple, which: str, rank: int, in_out: tuple[int, int]) -> None:
    d_in, d_out = in_out
    want = (rank, d_in) if which == "A" else (d_out, rank)
    if shape != want:
        raise AdapterValidationError(
            f"tensor {key!r} has shape {list(shape)}; the base model needs {list(want)} for rank {rank}"
        )


def check_files(path: str | Path, roots: tuple[str, ...] | None = None) -> None:
    """Refuse pickled weights and, with `roots`, any entry whose real path (symlinks resolved)
    leaves them: a directory under a root may hold symlinks to files anywhere."""
    d = Path(path)
    if not d.is_dir():
        raise AdapterValidationError("lora_path is not a directory", f"{str(d)!r}")
    if roots and not is_under_roots(d, roots):
        raise AdapterValidationError(
            "lora_path resolves outside the adapter roots", f"{str(d)!r} resolves to {os.path.realpath(d)!r}"
        )
    for top, dirs, files in os.walk(d):  # symlinked directories are listed, not followed
        for entry in (*dirs, *files):
            p = Path(top) / entry
            if roots and not is_under_roots(p, roots):
                raise AdapterValidationError(
                    f"{p.relative_to(d)} resolves outside the adapter roots",
                    f"{p.relative_to(d)} resolves to {os.path.realpath(p)!r}, outside {list(roots)}",
                )
            if entry.lower().endswith(PICKLE_SUFFIXES):
                raise AdapterValidationError(
                    f"{p.relative_to(d)} is a pickle file, which can run code when loaded; convert the adapter "
                    f"to safetensors ({WEIGHTS_FILE}, e.g. save_pretrained(..., safe_serialization=True)) "
                    "and remove the pickle file"
                )


def inspect_adapter(
    path: str | Path, base: BaseModelShapes, max_rank: int, roots: tuple[str, ...] | None = None
) -> AdapterInfo:
    """Read and check an adapter directory; raise AdapterValidationError naming the first problem.
    With `roots`, every file must also resolve under one of them (`check_files`)."""
    d = Path(path)
    with unreadable_as_invalid(d):
        check_files(d, roots)
        rank, alpha = _check_config(_read_config(d), max_rank)
        weights = d / WEIGHTS_FILE
        if not weights.is_file():
            raise AdapterValidationError(f"{WEIGHTS_FILE} not found in the adapter directory", f"{str(d)!r}")
        targets = _check_tensors(weights, rank, base)
        return AdapterInfo(
            path=str(d.resolve()),
            rank=rank,
            alpha=alpha,
            target_modules=targets,
            size_bytes=weights.stat().st_size,
        )


@contextlib.contextmanager
def unreadable_as_invalid(path: Path) -> Iterator[None]:
    """An adapter path the OS refuses to look up or read (a name too long, a NUL, no permission, a
    file vanishing mid-check) is an invalid adapter, not a server error; the OS's words (which name
    the path) go to the log only."""
    try:
        yield
    except (OSError, ValueError) as e:
        if isinstance(e, AdapterValidationError):
            raise
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "it cannot be looked up"
        raise AdapterValidationError(f"lora_path cannot be read: {reason}", f"{str(path)!r}: {e}") from None


def is_under_roots(path: str | Path, roots: tuple[str, ...]) -> bool:
    """True when `path` resolves (symlinks followed) inside one of `roots`; False for a path the OS
    cannot resolve at all (a NUL in it)."""
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return False
    return any(real.is_relative_to(Path(os.path.realpath(r))) for r in roots)
