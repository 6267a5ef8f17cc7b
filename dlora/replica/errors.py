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
