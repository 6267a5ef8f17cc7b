"""Per-adapter SLO-aware serving: pure policies over plain dataclasses (no engine, no clock).

- `config`: `SloConfig` (defaults, which order and dispatch) and a per-adapter `AdapterSlo`;
- `isolated`: a request's isolated execution time from the replica cost model (SeaLLM's L̂);
- `attainment`: per-request attainment (TTFT and TPOT both met), per-adapter counters, SeaLLM's
  normalized latency (Eq. 1);
- `priority`: SeaLLM's preemptive doubling-budget order (§4.2, Algorithm 2);
- `kv_shares`: MuxServe's per-adapter KV block quotas with lending (ADBS, Algorithm 3);
- `reopt_period`: SeaLLM's adaptive re-optimisation period (Eq. 8);
- `accounting`: which SLO each finished request is held to and the per-adapter counts (what the
  router exports to /metrics and `dlora bench` reports);
- `listing`: SLOs as `GET /v1/adapters` shows them, and read back by a client.

Aladdin's SLO-feasible dispatch checks replicas' views, so it is the cluster's
(`dlora.cluster.feasible_dispatch`); this package imports only the leaves `dlora.kinds` and
`dlora.cost.params`.

Each "LLM service" of those papers is one adapter here: adapters share the base model, its KV
layout and its per-token cost; they differ in popularity, lengths and SLO.

Nothing is re-exported: callers import from the module that defines a name.
"""
