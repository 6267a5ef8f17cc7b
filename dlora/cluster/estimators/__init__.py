"""What the router expects of a replica and a request, learned from what it measured.

- `replica_cost`: seconds of engine work a replica has outstanding (dispatch, the co-migration ILP);
- `output_lengths`: how many tokens a request will still generate, per adapter;
- `wait_estimate`: how long each queued request still waits on a replica before it starts;
- `held_work`: what a replica's held requests still take, simulated from sampled lengths;
- `replica_sim`: one replica's continuous batching, simulated: when each of a queue of requests
  finishes (the migration check and the batch planner run it);
- `survival`: output lengths with cap hits and running requests censored (Kaplan-Meier), for the
  batch planner.
"""
