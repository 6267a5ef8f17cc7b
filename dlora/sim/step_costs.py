"""How long one engine step takes in the replica simulator: a linear model per weight state.

    t(step) = fixed + per_seq * sequences + per_prefill_token * prompt tokens prefilled
              (+ per_adapter * distinct adapters, unmerged only)

Merged steps (one adapter folded into the weights, its requests run with no LoRA term) use the
base-model coefficients; unmerged steps pay the LoRA term. Switches cost `merge_cold_s` for an
adapter whose merged weights are not cached, `merge_cached_s` for one that is (the worker keeps
`merged_cache_entries` adapters' merged kernels, LRU), and `unmerge_s`.

The presets are fitted to measured steps, so policies can be compared without the machine's
noise (and with it, through `noise_sd`):
- `cpu-einsum`: SmolLM2-135M bf16, one core, dlora's einsum LoRA kernels, 8 rank-8 q/k/v/o
  adapters; least squares over ~6,000 traced decode and prefill steps of the skew benchmark
  (`DLORA_STEP_TRACE`): unmerged 42 + 2.2 n ms + 1.56 ms per prompt token, merged
  36.6 + 2.1 n ms + 1.31 ms per prompt token; switches timed in-process (cold merge 130-210 ms
  through vLLM's reload, cached merge 1.3 ms, unmerge 1.6 ms).
- `cpu-vllm-ops`: the same model with vLLM's own CPU LoRA ops, whose unmerged decode steps cost
  2.5-3x a merged one (a skew-benchmark run with that backend: TPOT 145-155 ms unmerged vs
  54-59 ms merged; this preset gives 165-175 ms per output token unmerged where that run measured
  143-161).
- `gpu-like`: a GPU-shaped regime: merged at 0.6 of unmerged cost, a 20 ms switch.

Why this model is given, not fitted (the others, `dlora.cost`, learn from measured steps): a
simulator must *produce* step times, with the LoRA term and switch costs separate, so its step is
two `StepLine`s, the base model's (`base`) and the LoRA term's (`lora`), plus a per-adapter cost.
`model_io.ReplicaModel.cost_params` turns it into the router's `CostParams`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dlora.cost.line import StepLine
from dlora.models.projections import ALL_PROJECTIONS, QKVO


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float
    per_seq_s: float
    per_prefill_token_s: float
    lora_fixed_s: float  # extra per unmerged step with any adapter token (the LoRA layers' calls)
    lora_per_seq_s: float  # extra per adapter sequence in an unmerged step
    lora_per_prefill_token_s: float
    lora_per_adapter_s: float = 0.0  # extra per distinct adapter in an unmerged step
    merge_cold_s: float = 0.15
    merge_cached_s: float = 0.0015
    unmerge_s: float = 0.0015
    merged_cache_entries: int = 8

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"StepCosts.{f.name} must be >= 0")

    def step(self, seqs: int, prefill_tokens: int, lora_seqs: int, lora_prefill_tokens: int, adapters: int) -> float:
        """Seconds of one step: `lora_*` count the sequences and prompt tokens that apply a LoRA
        term (none while their adapter is merged), `adapters` the distinct adapters among them."""
        t = self.base.seconds(prefill_tokens, seqs)
        if lora_seqs:
            t += self.lora.seconds(lora_prefill_tokens, lora_seqs) + self.lora_per_adapter_s * adapters
        return t

    @property
    def base(self) -> StepLine:
        """The base model's step: what a merged step, or one with no adapter token, costs."""
        return StepLine(self.fixed_s, self.per_prefill_token_s, self.per_seq_s)

    @property
    def lora(self) -> StepLine:
        """What the LoRA term adds to an unmerged step with adapter tokens (before the per-adapter cost)."""
        return StepLine(self.lora_fixed_s, self.lora_per_prefill_token_s, self.lora_per_seq_s)


PRESETS: dict[str, StepCosts] = {
    "cpu-einsum": StepCosts(
        fixed_s=0.0366,
        per_seq_s=0.0021,
        per_prefill_token_s=0.00131,
        lora_fixed_s=0.0054,
        lora_per_seq_s=0.0001,
        lora_per_prefill_token_s=0.00025,
        merge_cold_s=0.17,
        merge_cached_s=0.0013,
        unmerge_s=0.0016,
    ),
    "cpu-vllm-ops": StepCosts(
        fixed_s=0.0366,
        per_seq_s=0.0021,
        per_prefill_token_s=0.00131,
        lora_fixed_s=0.045,
        lora_per_seq_s=0.002,
        lora_per_prefill_token_s=0.0015,
        lora_per_adapter_s=0.001,
        merge_cold_s=0.13,
        merge_cached_s=0.0013,
        unmerge_s=0.0013,
    ),
    "gpu-like": StepCosts(
        fixed_s=0.012,
        per_seq_s=0.0002,
        per_prefill_token_s=0.00003,
        lora_fixed_s=0.006,
        lora_per_seq_s=0.0002,
        lora_per_prefill_token_s=0.00002,
        lora_per_adapter_s=0.0004,
        merge_cold_s=0.02,
        merge_cached_s=0.02,
        unmerge_s=0.02,
    ),
}


def preset(name: str) -> StepCosts:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown step-cost preset {name!r}: choose from {', '.join(PRESETS)}") from None


# --- Step costs for another LoRA shape and prompt length -------------------------------------
#
# The presets are fitted to one regime: rank-8 adapters on q/k/v/o, 64-token prompts. For another
# rank, projection set or prompt length, `regime_costs` rescales them with a small FLOP model:
#
# - LoRA per-token terms (`lora_per_seq_s`, `lora_per_prefill_token_s`): their `flop_share`
#   scales with the LoRA multiply-adds per token, layers x sum over the adapted projections of
#   r x (in + out) (the kernels' cost per FLOP, whatever it is on a machine, is taken from the
#   preset's own fit), the rest with the LoRA layer calls (per-call overhead).
# - The LoRA fixed cost (`lora_fixed_s`, `lora_per_adapter_s`) scales with the LoRA layer calls
#   per decoder layer: vLLM fuses q/k/v into one layer and gate/up into another, so q/k/v/o is
#   two calls and all seven projections four.
# - Attention grows with the context: a decode step attends over prompt + half the output on
#   average, and a prompt token over half the prompt, at 2 x heads x head_dim multiply-adds per
#   context token and layer, each costing `attention_weight` linear-layer multiply-adds. The base
#   per-sequence and per-prompt-token terms scale by
#   (base + attention at this context) / (base + attention at the preset's context).
# - A cold merge reloads the adapted projections' weights: it scales with their parameter count,
#   and the merged-kernel cache, a byte budget, holds fewer adapters in that proportion.


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that the FLOP model needs."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every LoRA-adaptable projection of one layer."""
        h, kv, m = self.hidden, self.kv_heads * self.head_dim, self.intermediate
        return {
            "q_proj": (h, h),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj": (h, m),
            "up_proj": (h, m),
            "down_proj": (m, h),
        }

    def base_macs_per_token(self) -> int:
        """Multiply-adds of one token through every linear layer and the LM head (no attention)."""
        return self.layers * sum(i * o for i, o in self.projection_dims().values()) + self.hidden * self.vocab

    def attention_macs(self, context: float) -> float:
        """Multiply-adds of one token attending over `context` earlier tokens (QK^T and AV)."""
        return self.layers * 2 * self.heads * self.head_dim * context

    def weight_params(self, modules: tuple[str, ...]) -> int:
        dims = self.projection_dims()
        return self.layers * sum(dims[p][0] * dims[p][1] for p in modules)


# SmolLM2-135M (the default model's config.json)
SMOLLM2_135M = ModelShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, vocab=49152)

FUSED_LORA_LAYERS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class LoraShape:
    rank: int
    modules: tuple[str, ...] = QKVO

    def __post_init__(self) -> None:
        unknown = set(self.modules) - set(ALL_PROJECTIONS)
        if self.rank < 1 or not self.modules or unknown:
            raise ValueError(
                f"LoraShape(rank={self.rank}, modules={self.modules}): rank >= 1, modules from {ALL_PROJECTIONS}"
            )

    def macs_per_token(self, model: ModelShape) -> int:
        dims = model.projection_dims()
        return model.layers * sum(self.rank * (dims[p][0] + dims[p][1]) for p in self.modules)

    def lora_layer_calls(self) -> int:
        """LoRA layer calls per decoder layer: fused q/k/v and gate/up count once."""
        return sum(any(p in self.modules for p in group) for group in FUSED_LORA_LAYERS)


@dataclass(frozen=True)
class Regime:
    """What a preset was fitted to, or what it is rescaled to."""

    lora: LoraShape
    prompt_len: int
    output_len: int


PRESET_REGIME = Regime(LoraShape(8, QKVO), prompt_len=64, output_len=64)


def lora_flop_ratio(lora: LoraShape, model: ModelShape = SMOLLM2_135M) -> float:
    """LoRA multiply-adds per token relative to the base model's linear layers and LM head."""
    return lora.macs_per_token(model) / model.base_macs_per_token()


def regime_costs(
    costs: StepCosts,
    to: Regime,
    fitted: Regime = PRESET_REGIME,
    model: ModelShape = SMOLLM2_135M,
    flop_share: float = 1.0,
    attention_weight: float = 1.0,
) -> StepCosts:
    """`costs`, fitted at `fitted`, rescaled to the regime `to` by the FLOP model above.

    `flop_share` is the part of the fitted LoRA per-token cost that is multiply-adds; the rest is
    per-call overhead (reading the adapter's weights, a kernel launch), which scales with the LoRA
    layer calls like the fixed cost. 1 scales it all with FLOPs. `attention_weight` is what an
    attention multiply-add costs relative to a linear layer's (CPU attention kernels run far below
    GEMM speed)."""
    if not 0 <= flop_share <= 1:
        raise ValueError(f"flop_share {flop_share} must be in [0, 1]")
    calls = to.lora.lora_layer_calls() / fitted.lora.lora_layer_calls()
    flops = to.lora.macs_per_token(model) / fitted.lora.macs_per_token(model)
    per_token = flop_share * flops + (1 - flop_share) * calls
    base = model.base_macs_per_token()

    def attention(context: float) -> float:
        return (base + attention_weight * model.attention_macs(context)) / base

    decode = attention(to.prompt_len + to.output_len / 2) / attention(fitted.prompt_len + fitted.output_len / 2)
    prefill = attention(to.prompt_len / 2) / attention(fitted.prompt_len / 2)
    weights = model.weight_params(to.lora.modules) / model.weight_params(fitted.lora.modules)
    return dataclasses.replace(
        costs,
        per_seq_s=costs.per_seq_s * decode,
        per_prefill_token_s=costs.per_prefill_token_s * prefill,
        lora_fixed_s=costs.lora_fixed_s * calls,
        lora_per_seq_s=costs.lora_per_seq_s * per_token,
        lora_per_prefill_token_s=costs.lora_per_prefill_token_s * per_token,
        lora_per_adapter_s=costs.lora_per_adapter_s * calls,
        merge_cold_s=costs.merge_cold_s * weights,
        merged_cache_entries=max(1, int(costs.merged_cache_entries / weights)),
    )
