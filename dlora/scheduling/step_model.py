"""Step time by weight state and token mix, learned online: what the merge planner prices work with.

    t(step) = fixed + per_prefill_token · prompt tokens computed + per_seq · sequences scheduled

one line per weight state (UNMERGED: every LoRA term applied; MERGED: one adapter in the weights,
its requests with no LoRA term). Why tokens and not only the batch size (`iteration_time.py`): a step
that prefills 2,000 prompt tokens costs 30-60x a decode step of the same requests on a CPU, and
merging pays most on exactly those tokens (a merged prefill runs at base-model speed, while LoRA
adds 0.3 ms per prompt token at rank 8 and 1.3 ms at rank 64 to a 1.7 ms base on one core,
SmolLM2-135M), so a model of batch size alone cannot see where merging pays.

Fit (`dlora.cost.fit`): exponentially weighted least squares of relative errors (each step weighted by 1/t², so a
30 s prefill step does not drown the 50 ms decode steps whose fixed cost the planner multiplies by
every decode step), with a ridge pull toward a prior line, solved as a small constrained least-squares problem. The
prior keeps the fit defined before the steps have varied enough to separate the three
coefficients (decode-only steps say nothing about the prompt-token cost, and decode steps of one
batch size cannot split their fixed and per-sequence costs; `StepTimeModel.line` says which prior
each mode gets).

Other step-time models, and why this one differs: `iteration_time.IterationTimeModel` (Alg. 2's
IterationTime(B), batch size only), `dlora.cluster.estimators.replica_cost` (the router's
per-replica model, additive per request for the co-migration ILP) and `dlora.sim.step_costs`
(the simulators' given coefficients). This one answers what the merge planner asks inside the
engine: the time of known work in either weight state.
"""

from __future__ import annotations

from dlora.cost.fit import fit_nonnegative
from dlora.cost.line import StepLine
from dlora.scheduling.iteration_time import FIXED_SHARE
from dlora.scheduling.types import Mode

DECAY = 0.98  # weight of the past per new step (memory of roughly 50 steps)
PRIOR_WEIGHT = 0.5  # the prior counts as this many steps
SHAPE_SPREAD = 0.05  # decode batch sizes must spread this much (sd / mean) to split fixed from per-sequence
SHAPE_DECAY = 0.999
# Feature scales, so the ridge pull weighs the three coefficients alike: a step's fixed cost, the
# cost of 1,000 prompt tokens, the cost of 16 sequences.
SCALES = (1.0, 1000.0, 16.0)


class _RidgeFit:
    """Decayed sums of x·xᵀ and x·t over the scaled features (1, prefill/1000, seqs/16)."""

    def __init__(self) -> None:
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xt = [0.0] * 3
        self.steps = 0.0  # decayed count
        # Decode-only steps (no prompt token), relative-error weighted like the rest: Σw, Σw·n,
        # Σw·n², Σw·t, Σw·n·t, decayed as the rest (their mean) and slowly (their shape: how a
        # step's time splits into fixed and per-sequence cost is the machine's, and one probe of
        # another batch size should keep it known for hundreds of steps).
        self.decode = [0.0] * 5
        self.shape = [0.0] * 5
        self.decode_steps = 0.0

    def add(self, prefill_tokens: float, seqs: float, seconds: float) -> None:
        w = 1.0 / (seconds * seconds)
        x = (1.0, prefill_tokens / SCALES[1], seqs / SCALES[2])
        for i in range(3):
            self.xt[i] = self.xt[i] * DECAY + w * x[i] * seconds
            for j in range(3):
                self.xx[i][j] = self.xx[i][j] * DECAY + w * x[i] * x[j]
        self.steps = self.steps * DECAY + 1.0
        if prefill_tokens == 0:
            terms = (w, w * seqs, w * seqs * seqs, w * seconds, w * seqs * seconds)
            self.decode = [d * DECAY + t for d, t in zip(self.decode, terms)]
            self.shape = [d * SHAPE_DECAY + t for d, t in zip(self.shape, terms)]
            self.decode_steps = self.decode_steps * DECAY + 1.0

    def line(self, prior: StepLine, data_only_prefill: bool = False) -> StepLine:
        """The fit, pulled toward `prior` (which it equals with no data) by PRIOR_WEIGHT steps'
        worth of relative error per coefficient; `data_only_prefill`: the prompt-token cost is
        left to the data (a vanishing pull only)."""
        scaled = [prior.fixed_s, prior.per_prefill_token_s * SCALES[1], prior.per_seq_s * SCALES[2]]
        floor = max(0.1 * max(scaled), 1e-9)
        pull = [PRIOR_WEIGHT / max(v, floor) ** 2 for v in scaled]
        if data_only_prefill:
            pull[1] = 1e-6 * max(self.xx[i][i] for i in range(3))
        x = fit_nonnegative(self.xx, self.xt, prior=scaled, pull=pull)
        if x is None:
            return prior
        return StepLine(x[0], x[1] / SCALES[1], x[2] / SCALES[2])

    def decode_mean(self) -> tuple[float, float] | None:
        """The weighted mean (sequences, seconds) of the decode steps seen, or None."""
        w, wn, _, wt, _ = self.decode
        return None if w == 0 else (wn / w, wt / w)

    def decode_shape(self) -> tuple[float, float] | None:
        """(fixed, per-sequence) seconds of a decode step, fitted from decode steps alone, where
        their batch sizes varied enough to separate the two (relative spread >= 10%); else None."""
        w, wn, wnn, wt, wnt = self.shape
        if self.decode_steps < 2 or w == 0:
            return None
        mean_n = wn / w
        var = wnn / w - mean_n * mean_n
        if mean_n <= 0 or var < (SHAPE_SPREAD * mean_n) ** 2:
            return None
        per_seq = max(0.0, (wnt / w - mean_n * wt / w) / var)
        return max(0.0, wt / w - per_seq * mean_n), per_seq


def decode_prior(mean: tuple[float, float] | None, shape: tuple[float, float] | None) -> StepLine:
    """A line through the mean decode step (sequences, seconds) with the fixed/per-sequence split
    of `shape`, or `FIXED_SHARE` of it fixed without one; all prompt-token cost left to the data.
    Why: decode steps of one batch size (a burst whose requests all run to the same length)
    cannot split a step's fixed cost from its per-sequence cost, yet the planner's choice turns on
    it: a merged slice runs fewer sequences per step, and pays the fixed cost on every step."""
    if mean is None or mean[0] <= 0:
        return StepLine(0.0, 0.0, 0.0)
    seqs, seconds = mean
    if shape is None or shape[0] + shape[1] * seqs <= 0:
        return StepLine(FIXED_SHARE * seconds, 0.0, (1 - FIXED_SHARE) * seconds / seqs)
    scale = seconds / (shape[0] + shape[1] * seqs)
    return StepLine(shape[0] * scale, 0.0, shape[1] * scale)


class StepTimeModel:
    """One `StepLine` per weight state, learned from measured steps."""

    def __init__(self, merged_cost_ratio: float) -> None:
        self.merged_cost_ratio = merged_cost_ratio
        self._fits = {Mode.UNMERGED: _RidgeFit(), Mode.MERGED: _RidgeFit()}

    def observe(self, mode: Mode, prefill_tokens: int, seqs: int, seconds: float) -> None:
        """One measured step (switch time excluded)."""
        if seqs > 0 and seconds > 0:
            self._fits[mode].add(float(prefill_tokens), float(seqs), seconds)

    def steps_seen(self, mode: Mode) -> float:
        """Measured steps in `mode`, decayed (recent steps count most)."""
        return self._fits[mode].steps

    def shape_known(self) -> bool:
        """Whether decode steps of different batch sizes, in either mode, split a step's fixed
        cost from its per-sequence cost."""
        return any(f.decode_shape() is not None for f in self._fits.values())

    def line(self, mode: Mode) -> StepLine | None:
        """The step line of `mode`; None before an unmerged decode step was measured.

        UNMERGED is pulled toward a line through its mean decode step, split as its own decode
        steps show, else as the merged ones do (both modes share the base model's step), else half
        and half. MERGED is pulled toward UNMERGED's line times `merged_cost_ratio` (optimistic,
        so that where merging may pay a slice is tried, and then priced as measured), fixed cost
        included. Why no line before a decode step: a prefill says nothing of a step's fixed cost,
        and with none, merging adapters one after another looks free against batching them."""
        u, m = self._fits[Mode.UNMERGED], self._fits[Mode.MERGED]
        mean = u.decode_mean()
        if mean is None:
            return None
        unmerged = u.line(decode_prior(mean, u.decode_shape() or m.decode_shape()), data_only_prefill=True)
        if mode is Mode.UNMERGED:
            return unmerged
        return m.line(unmerged.scaled(self.merged_cost_ratio))
