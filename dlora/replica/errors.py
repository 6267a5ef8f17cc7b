"""Errors a replica raises to the router."""


class ReplicaFailure(RuntimeError):
    """The replica (actor or engine) failed; the request may be resubmitted elsewhere."""


class EngineNotStarted(ReplicaFailure):
    """The replica has no engine: `start()` has not run in this process, or the engine was shut down.

    Ray restarts a killed replica actor (e.g. by the OOM killer; `max_restarts`) by running only its
    `__init__` in a new process, so the new process has no engine until the router starts it again.
    Raised inside the actor, it crosses Ray as a `RayTaskError` whose cause is this class, which the
    router-side handle turns into a `ReplicaFailure`: the router then rebuilds the replica.
    """


class RequestRejected(ValueError):
    """The engine refused the request's own values (vLLM's input checks: sampling parameters, token
    ids, lengths). The request fails alone, with a 400; it is not resubmitted and its replica is fine.

    Raised on the router side by the replica handle when the actor's exception is a ValueError or
    TypeError that vLLM raised before running the request; `param` names the field when known.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class AdapterUnavailable(RuntimeError):
    """A replica cannot get an adapter's files onto its node (the transfer failed, or the bytes
    that came do not have the adapter's digest). Only that adapter's requests on that replica
    fail; the router sends them to another replica."""

    def __init__(self, name: str, node: str, why: str):
        super().__init__(f"adapter {name!r} is unavailable on node {node}: {why}")
        self.name = name
        self.node = node
        self.why = why

    def __reduce__(self):  # crosses Ray as the cause of a task error: rebuilt from its three parts
        return (type(self), (self.name, self.node, self.why))
