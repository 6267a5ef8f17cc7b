"""The host side of a replica: the Ray actor and the vLLM engine it drives.

- `ray_replica`: the Ray actor and its handle (runtime env, core pinning, failures);
- `engine`: `EngineHost`, the AsyncLLM wrapper, and the engine arguments that load dlora's
  scheduler and worker extension (`dlora.engine_ext`, the code that runs inside vLLM);
- `messages`: the dataclasses crossing the actor boundary;
- `errors`: the replica failures the router and server tell apart.
"""
