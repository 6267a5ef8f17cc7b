"""Co-migration (dLoRA §5.2): when to move requests between replicas, and which ones.

- `trigger`: dLoRA's triggers (KV use, request-count imbalance, queueing delay) that start a round;
- `queued`: cheap moves of queued requests to replicas that can start them now (every tick);
- `rebalance`: queued requests moved between busy replicas where they would start sooner;
- `problem`: the co-migration problem built from a cluster snapshot, and a plan's checks;
- `ilp`: the problem as a PuLP model, solved relaxed and rounded;
- `greedy`: the fallback planner when the solver fails or runs out of time;
- `lp_solve`: a PuLP solve (HiGHS or CBC) under a hard wall-clock deadline.
"""
