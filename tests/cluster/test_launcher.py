"""Joining a Ray cluster: a failure becomes one line naming the setting and the cause (the real
join, and the real token failure, are in tests/server/test_ray_join.py)."""

from dlora.cluster.launcher import join_failure


def ray_connection_error(inner: str) -> ConnectionError:
    """The shape Ray 2.x raises: a ConnectionError whose cause carries the real error as traceback text."""
    try:
        try:
            raise RuntimeError(
                f"Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
                f'  File "node.py", line 996, in _init_gcs_client\n{inner}'
            )
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379") from cause
    except ConnectionError as e:
        return e


def test_a_missing_token_says_how_to_give_one():
    e = ray_connection_error("ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: token is missing")
    msg = join_failure("10.0.0.5:6379", e)
    assert msg.startswith("cluster.ray_address='10.0.0.5:6379': could not join the Ray cluster: ")
    assert "RAY_AUTH_MODE=token" in msg and "RAY_AUTH_TOKEN" in msg
    assert "\n" not in msg and "Traceback" not in msg


def test_an_unreachable_cluster_says_so_in_one_line():
    e = ray_connection_error("TimedOut: Timed out while waiting for GCS to become available.")
    msg = join_failure("10.0.0.5:6379", e)
    assert msg == (
        "cluster.ray_address='10.0.0.5:6379': could not join the Ray cluster: "
        "ConnectionError: Failed to connect to Ray cluster at 10.0.0.5:6379"
    )


def test_replicas_get_their_cores_in_order_cores_per_replica_each():
    from dlora.cluster.launcher import replica_cores
    from dlora.config import ClusterConfig, DloraConfig

    def cores(**cluster):
        return replica_cores(DloraConfig(cluster=ClusterConfig(**cluster)))

    assert cores(num_replicas=2, cpu_cores=(3, 5)) == [(3,), (5,)]
    assert cores(num_replicas=1, cpu_cores=(0, 1), cores_per_replica=2) == [(0, 1)]
    assert cores(num_replicas=3, cpu_cores=(0, 1, 2, 3), cores_per_replica=2) == [(0, 1), (2, 3), (0, 1)]  # wraps
