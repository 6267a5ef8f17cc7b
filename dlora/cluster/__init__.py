"""The cluster layer: one router in the server process in front of many replicas.

- `router`: a request's stream over its legs, migration and resubmission, adding and draining
  replicas; it composes `replica_pool` (replicas, failures, rebuilds), `adapter_residency` (which
  adapter is where), `request_table` (requests in flight, the dispatch sums), `replica_views`,
  `replica_choice` (the replica for each leg), `router_counters`, `stats_reader`, `request_leg`
  and `deadlines`;
- `balancer`: the monitor loop: reads replica stats, runs migration rounds and the adapter preload;
- `dispatch`: which replica a new request goes to (`proactive`, `least_loaded`, `round_robin`);
- `placement`: the periodic adapter preload that raises burst tolerance (dLoRA §5.1);
- `policy_views`: the plain dataclasses the pure policies read (`ReplicaView`, `ClusterView`, ...);
- `migration/`: co-migration (dLoRA §5.2): triggers, queued-request moves, the ILP and its fallback;
- `estimators/`: per-replica cost model, expected output lengths, queued requests' start times;
- `queue_time`: each request's queueing delay, as /metrics exports it;
- `launcher`: Ray start or join, replica placement on cores / GPUs;
- `errors`, `interruptible`: the typed failures a client sees; a replica stream a deadline can end.

Nothing is re-exported here: importing one pure policy must not import the router, Ray or the
solver, so callers import from the module that defines a name.
"""
