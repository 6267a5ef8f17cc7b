"""What a step of continuous batching costs: one model, one fitting routine.

    t(step) = fixed + per_prefill_token · prompt tokens computed + per_seq · sequences

is `line.StepLine`; `fit.fit_nonnegative` fits its coefficients (>= 0, pulled toward a prior) from
measured steps; `params.CostParams` is the line as requests are priced with it, plus the merged
ratio, the adapter load time and the batch size that shares a step's fixed cost.

Who estimates it, and why each estimate differs:

- `dlora.scheduling.iteration_time.IterationTimeModel`, in the engine: Alg. 2's IterationTime(B),
  a step of n requests per weight state. Batch size only, as the paper's throughput comparison
  asks; a mode never seen is the other one through the merged ratio.
- `dlora.scheduling.step_model.StepTimeModel`, in the engine: the merge planner's time of known
  work per weight state. Prompt tokens too (merging pays most on prefill), fitted on relative
  errors so that long prefill steps do not drown decode steps.
- `dlora.cluster.estimators.replica_cost.ReplicaCostModel`, in the router: a replica's pending
  seconds for dispatch, the co-migration ILP, SLOs and batch plans. One unmerged line per replica
  from the steps it reports (a few a second, not every step), its fixed cost shared by a full batch
  so that work adds up per request and the ILP stays linear.
- `dlora.sim.step_costs.StepCosts`, in the simulators: given, not fitted, because a simulator must
  produce step times, with the LoRA term (a second line) and switch costs apart.

The three that learn fit through `fit.fit_nonnegative`.
"""
