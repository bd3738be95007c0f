"""`mesh bench multicast --ray`: Mesh's multicast plans beside Ray's object-store broadcast.

The same M MB of random bytes go from one Ray node (the driver's) to N other Ray nodes, in
one run, three ways:

- `chain` and `binomial`: Mesh's weights transport (mesh.weights), a weights agent
  process on every node, started by a Ray actor pinned to it (node affinity); the
  coordinator (here) tells the agents the plan and they forward blocks to each other,
  checking each block's sha256;
- `ray_object_store`: `ray.put` once on the source node, then a call on an actor pinned to
  each receiving node that takes the object as its argument, so Ray's object manager brings
  it there (`ray.get` on each node); timed from reading the file to the last node holding it.

Each row has `total_s` and `bound_s` = M/B, B the single-stream bandwidth of Mesh's transport
between two of the nodes (best of `bw_repeats`), the same bound for every row.

Without an address, the benchmark starts a local `ray.cluster_utils.Cluster` with a head (the
source) and N worker nodes, all on 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), and shuts
it down at the end. On one machine, as in `mesh bench multicast`, all "links" share its
memory bandwidth and cores.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from mesh.bench.report import write_json
from mesh.engines.worker_process import worker_env
from mesh.lifetime import die_with_parent

MB = 10**6


class WeightsAgentActor:
    """On its node: one weights agent process (`python -m mesh.weights.peer`)."""

    def __init__(self, token: str, link_mbps: float | None = None) -> None:
        import ray

        from mesh.weights.peer import TOKEN_ENV

        host = ray.util.get_node_ip_address()
        cmd = [sys.executable, "-m", "mesh.weights.peer", "--host", host, "--port", "0"]
        if link_mbps is not None:
            cmd += ["--link-mbps", str(link_mbps)]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=worker_env(**{TOKEN_ENV: token}),
                                        preexec_fn=die_with_parent)
        parts = (self.process.stdout.readline() if self.process.stdout else "").split()
        if len(parts) != 3 or parts[0] != "READY":
            self.process.kill()
            raise RuntimeError(f"the weights agent did not start: {parts}")
        self._address = (parts[1], int(parts[2]))

    def address(self) -> tuple[str, int]:
        return self._address

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()


class ObjectReceiver:
    """On its node: takes the broadcast object as an argument (Ray brings it to the node)."""

    def ready(self) -> bool:
        return True

    def fetch(self, data: Any) -> int:
        return int(data.nbytes)


def local_cluster(nodes: int, object_store_bytes: int) -> Any:
    """A head (the source) and `nodes` workers on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    common = {"node_ip_address": "127.0.0.1", "object_store_memory": object_store_bytes}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **common})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=1, **common)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def run(receivers: int = 3, size_mb: float = 128, block_mb: float = 4, address: str | None = None,
        plans: Sequence[str] = ("chain", "binomial"), bw_repeats: int = 2, repeat: int = 1, seed: int = 0,
        link_mbps: float | None = None) -> dict[str, Any]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # read when ray is imported: keep it on 127.0.0.1
    import ray

    from mesh.bench.random_model import write_random_model

    if receivers < 1 or size_mb <= 0 or block_mb <= 0 or repeat < 1 or bw_repeats < 1:
        raise ValueError("--receivers, --size-mb, --block-mb, --repeat and --bw-repeats must be positive")
    size = int(size_mb * MB)
    cluster = None
    if address is None:
        cluster = local_cluster(receivers, max(2 * size + (64 << 20), 256 << 20))
        address = cluster.address
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
        try:
            with tempfile.TemporaryDirectory(prefix="mesh-multicast-ray-") as tmp:
                model = Path(tmp) / "model.bin"
                write_random_model(model, size, seed)
                return _bench(ray, model, receivers, block_mb, plans, bw_repeats, repeat, link_mbps,
                              "local Cluster" if cluster is not None else address)
        finally:
            ray.shutdown()
    finally:
        if cluster is not None:
            cluster.shutdown()


def _bench(ray: Any, model: Path, receivers: int, block_mb: float, plans: Sequence[str], bw_repeats: int,
           repeat: int, link_mbps: float | None, where: str) -> dict[str, Any]:
    import numpy as np
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from mesh.policy.multicast import make_plan, naive
    from mesh.weights.blocks import pack
    from mesh.weights.coordinator import multicast
    from mesh.weights.launch import new_token

    source_node = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != source_node]
    if len(others) < receivers:
        raise ValueError(f"the Ray cluster has {len(others)} nodes besides the driver's; --receivers {receivers} "
                         "needs that many")
    on = {"src": source_node, **{f"r{i}": others[i] for i in range(receivers)}}

    def pinned(cls: Any, node: str) -> Any:
        return ray.remote(cls).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))

    token = new_token()
    manifest = pack(model, int(block_mb * MB), model="random-model")
    agents = {name: pinned(WeightsAgentActor, node).remote(token, link_mbps) for name, node in on.items()}
    catchers = [pinned(ObjectReceiver, on[f"r{i}"]).remote() for i in range(receivers)]
    try:
        addresses = {name: tuple(addr) for name, addr in zip(agents,
                                                             ray.get([a.address.remote() for a in agents.values()]))}
        ray.get([c.ready.remote() for c in catchers])  # workers started before any clock runs
        targets = [f"r{i}" for i in range(receivers)]

        async def mesh_rows() -> dict[str, Any]:
            singles = []
            for i in range(bw_repeats):
                r = await multicast(addresses, manifest, naive(["src"], ["r0"], manifest.count), {"src": str(model)},
                                    transfer_id=f"bw{i}", token=token)
                singles.append(r.total_s)
            out: dict[str, Any] = {"single_stream_s": singles}
            for name in plans:
                plan = make_plan(name, ["src"], targets, manifest.count)
                runs = []
                for i in range(repeat):
                    r = await multicast(addresses, manifest, plan, {"src": str(model)}, transfer_id=f"{name}{i}",
                                        token=token)
                    runs.append(r.total_s)
                out[name] = sorted(runs)[len(runs) // 2]
                out[f"{name}_runs"] = runs
            return out

        mesh = asyncio.run(mesh_rows())
        bound = min(mesh["single_stream_s"])  # M/B, B = M / the best single-stream time
        ray_runs, put_runs = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            data = np.fromfile(model, dtype=np.uint8)
            ref = ray.put(data)
            put_runs.append(time.perf_counter() - t0)
            got = ray.get([c.fetch.remote(ref) for c in catchers])
            ray_runs.append(time.perf_counter() - t0)
            assert got == [manifest.total_bytes] * receivers
            del ref, data
        fig: dict[str, Any] = {
            "receivers": receivers, "size_mb": manifest.total_bytes / MB, "block_mb": manifest.blocks[0].size / MB,
            "blocks": manifest.count, "cluster": where, "ray_nodes": receivers + 1, "link_mbps": link_mbps,
            "bandwidth_MBps": manifest.total_bytes / min(mesh["single_stream_s"]) / MB,
            "single_stream_s": mesh["single_stream_s"], "bound_s": bound, "cpu_count": os.cpu_count(),
            "rows": [*plans, "ray_object_store"],
        }
        for name in plans:
            fig[name] = {"total_s": mesh[name], "bound_s": bound, "ratio": mesh[name] / bound,
                         "runs_total_s": mesh[f"{name}_runs"], "how": "Mesh weights transport, sha256 per block"}
        total = sorted(ray_runs)[len(ray_runs) // 2]
        fig["ray_object_store"] = {"total_s": total, "bound_s": bound, "ratio": total / bound,
                                   "put_s": sorted(put_runs)[len(put_runs) // 2], "runs_total_s": ray_runs,
                                   "how": "ray.put once on the source node, fetched by an actor on each receiver"}
        return fig
    finally:
        for a in agents.values():
            try:
                ray.get(a.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - killed next
                pass
            ray.kill(a)
        for c in catchers:
            ray.kill(c)


def report(fig: dict[str, Any], json_path: str | None) -> None:
    print(f"mesh bench multicast --ray: 1 source -> {fig['receivers']} Ray nodes ({fig['cluster']}), "
          f"{fig['size_mb']:.0f} MB in {fig['blocks']} blocks of {fig['block_mb']:.1f} MB")
    print(f"  single-stream B = {fig['bandwidth_MBps']:.0f} MB/s (Mesh transport), bound M/B = {fig['bound_s']:.3f} s"
          f" on {fig['cpu_count']} cores")
    print(f"  {'row':<17} {'total_s':>8} {'bound_s':>8} {'x bound':>8}")
    for name in fig["rows"]:
        row = fig[name]
        print(f"  {name:<17} {row['total_s']:8.3f} {row['bound_s']:8.3f} {row['ratio']:8.2f}")
    if json_path:
        write_json(json_path, fig)
