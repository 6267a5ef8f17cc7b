"""Why the cluster could not serve a request: typed, so the HTTP layer maps each to its status.

Every class carries `http_status`; the route layer answers with it and the message (the message
names no replica process, actor or file: it is meant for the client).
"""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The cluster, not the request, is why the request failed (a 5xx)."""

    http_status = 503


class NoReplicaError(ClusterError):
    """No replica is up to take the request (all failed, or rebuilding)."""

    http_status = 503


class ResubmissionLimit(ClusterError):
    """The request's replica failed under it more often than `cluster.max_resubmissions` allows:
    it may be what kills them, so it is not sent to another one."""

    http_status = 502


class RequestTimeout(ClusterError):
    """The request passed its deadline (`server.request_timeout_s`); its engine work was aborted."""

    http_status = 504
