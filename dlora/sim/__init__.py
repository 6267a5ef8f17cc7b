"""Simulators: the real policies over modelled engines, fast and free of the machine's noise.

- `batching_sim`: one replica's batching, step by step (`BatchingSim`), with `step_costs`' model;
- `skew`: the skew benchmark's workloads through `batching_sim`;
- `toy_replica`: an in-process replica with a deterministic toy model and the Ray replica's
  interface (`ToyReplica`), for router tests and `cluster`;
- `cluster`: the real router, dispatch and balancer over toy replicas, in real time;
- `migration_bound`: what moving requests could gain, and the SLO-aware policies (SeaLLM's order,
  Aladdin's dispatch, MuxServe's KV quotas), in an event-driven model of several replicas
  (`replica_model`, its inputs and outcome in `model_io`, one class per discipline in `disciplines`);
- `elastic`: that model's replicas sized by the autoscaler;
- `slo_study`: bench/slo's three configurations in that model, their SLO report, and the fewest
  replicas that reach an attainment target.
"""
