"""A Ray cluster of several one-CPU nodes on this machine, for the ray executor's tests.

Each node is a raylet of its own (ray.cluster_utils.Cluster, Ray's own multi-node test
harness): placement groups, node ids and actor deaths behave as across machines. Nodes are
started and stopped through their process handles, never `ray stop` (which kills every Ray
process of the machine, other users' included).

Every address is 127.0.0.1: Ray otherwise swaps loopback for the machine's outward IP.
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's switch for that (its macOS default); the
processes started later (nodes, actors, `kvserve serve`) read it from the environment, this
one from ray_constants.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from tests.support.processes import wait_gone

_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def require_ray() -> None:
    """Skip without ray, except in CI (CI=true), whose `make test` installs kvserve[ray]."""
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("ray must be installed in CI: the test extra pulls in kvserve[ray]")
        pytest.skip("ray is not installed (pip install 'kvserve[ray]')")


@dataclass(frozen=True)
class RayCluster:
    """A running local cluster.

    Args:
        address: the head's HOST:PORT (also RAY_ADDRESS while the cluster runs).
        node_ids: every node's id, head first.
    """

    address: str
    node_ids: list[str]


@contextlib.contextmanager
def ray_on_loopback() -> Iterator[None]:
    """Ray in this process and in the processes started meanwhile uses 127.0.0.1 only."""
    import ray._private.ray_constants as ray_constants

    saved_env, saved_flag = os.environ.get(_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_LOOPBACK_ENV, None)
        else:
            os.environ[_LOOPBACK_ENV] = saved_env


@contextlib.contextmanager
def local_ray_cluster(num_nodes: int = 2, num_cpus_per_node: int = 1) -> Iterator[RayCluster]:
    """Start num_nodes nodes, set RAY_ADDRESS to the head; on exit disconnect, stop every
    node and fail if a process the cluster started outlives it."""
    import ray
    from ray._common.utils import reset_ray_address
    from ray._private.utils import read_ray_address
    from ray.cluster_utils import Cluster

    saved_address = os.environ.get("RAY_ADDRESS")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with ray_on_loopback():
        cluster = None
        try:
            cluster = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": num_cpus_per_node, "include_dashboard": False},
            )
            for _ in range(num_nodes - 1):
                cluster.add_node(num_cpus=num_cpus_per_node)
            cluster.wait_for_nodes()
            os.environ["RAY_ADDRESS"] = cluster.address
            node_ids = [node.node_id for node in cluster.list_all_nodes()]
            yield RayCluster(cluster.address, node_ids)
        finally:
            # Taken while they run: GCS, raylets, and the actors' processes under them.
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
            if ray.is_initialized():
                ray.shutdown()
            if cluster is not None:
                session_dir = cluster.head_node.get_session_dir_path()
                cluster.shutdown()
                shutil.rmtree(session_dir, ignore_errors=True)  # the nodes' logs and sockets
                latest = os.path.join(os.path.dirname(session_dir), "session_latest")
                if os.path.islink(latest) and os.readlink(latest) == session_dir:
                    os.unlink(latest)
                if read_ray_address() == cluster.address:
                    reset_ray_address()  # else `ray.init()` here would dial the dead cluster
            if saved_address is None:
                os.environ.pop("RAY_ADDRESS", None)
            else:
                os.environ["RAY_ADDRESS"] = saved_address
    alive = wait_gone(started, timeout_s=15)
    assert not alive, f"Ray processes outlived the cluster: {alive}"
