"""Errors a replica raises to the router."""


class ReplicaFailure(RuntimeError):
    """The replica (actor or engine) failed; the request may be resubmitted elsewhere."""
