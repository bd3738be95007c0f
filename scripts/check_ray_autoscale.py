"""Mesh's autoscaler (mesh.ray.node_autoscaler.RayAutoscaler) against Ray's fake multi-node
provider: does `request_resources` for the nodes Mesh wants grow the cluster, and does a
smaller request let Ray's autoscaler remove an idle node? docs/cluster.md records a run.

It drives the real RayAutoscaler.step() with a stand-in cluster control (its view: a node in use
and requests waiting refused, then nothing in use) instead of `mesh serve`: agents started on
fake nodes would add a minute of model loads to what is a check of the Ray wiring.

WARNING: ray.cluster_utils.AutoscalingCluster runs `ray stop --force`, which stops EVERY Ray
process of this user on the machine. Run it only where nothing else uses Ray. Not part of
the test suite for that reason. Usage: python3 scripts/check_ray_autoscale.py
"""
from __future__ import annotations

import asyncio
import copy
import os
import sys
import time
from types import SimpleNamespace

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402
from ray.cluster_utils import AutoscalingCluster  # noqa: E402

from mesh.ray.node_autoscaler import RayAutoscaler

# The fake provider's cluster config (Ray's wheel lacks the example.yaml AutoscalingCluster reads).
BASE = {"cluster_name": "fake_multinode", "max_workers": 8,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "available_node_types": {}, "head_node_type": "ray.head.default", "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1, "docker": {}, "auth": {"ssh_user": "ubuntu"}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [],
        "rsync_filter": [], "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": []}


class FakeProviderCluster(AutoscalingCluster):
    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kw):
        cfg = copy.deepcopy(BASE)
        cfg["available_node_types"] = dict(worker_node_types)
        cfg["available_node_types"]["ray.head.default"] = {"resources": head_resources, "node_config": {},
                                                           "max_workers": 0}
        cfg.update(kw)
        return cfg


def workers() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) >= 1)


def wait(pred, timeout: float = 120.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(1)
    return False


async def main() -> int:
    # A stand-in cluster control: node "a" runs an instance and a request, one more request waits refused.
    view = {"nodes": [{"node_id": "m-a", "instances": [{}], "running": 1, "queue_length": 1}]}
    waiting = [1]  # requests waiting in the dispatcher's queue
    control = SimpleNamespace(view=lambda: view, waiting=lambda: waiting[0])
    membership = SimpleNamespace(nodes={"ray-a": SimpleNamespace(released=False, agents={"m-a": None})}, alive={})
    scaler = RayAutoscaler(control, membership, idle_release_s=0.0)
    t0 = time.monotonic()
    decision = await scaler.step()
    grew = wait(lambda: workers() >= decision.wanted)
    print(f"in use 1 + refused requests: wanted {decision.wanted}; the cluster has {workers()} worker nodes "
          f"after {time.monotonic() - t0:.0f} s ({'ok' if grew else 'NOT grown'})", flush=True)
    view["nodes"][0].update(instances=[], running=0, queue_length=0)  # packed elsewhere: nothing in use
    waiting[0] = 0
    t0 = time.monotonic()
    decision = await scaler.step()
    shrank = wait(lambda: workers() <= decision.wanted)
    print(f"nothing in use: wanted {decision.wanted}; the cluster has {workers()} worker nodes after "
          f"{time.monotonic() - t0:.0f} s ({'ok' if shrank else 'NOT shrunk'})", flush=True)
    return 0 if grew and shrank else 1


if __name__ == "__main__":
    cluster = FakeProviderCluster(head_resources={"CPU": 0}, worker_node_types={
        "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 3}},
        idle_timeout_minutes=0.1)
    cluster.start(override_env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    try:
        ray.init("auto", log_to_driver=False)
        code = asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()
    sys.exit(code)
