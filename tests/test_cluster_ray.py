"""`mesh serve --ray` on a local multi-node Ray cluster (issue 12): real Ray processes
(`ray.cluster_utils.Cluster`, every node on 127.0.0.1), the real server, real node agents
started by Ray actors, the real SmolLM2 model. One cluster for the module (a start costs
about 10 s on two cores): a head without CPUs for Mesh (it gets no agent) and two workers.

One test walks through the story, in order, since each step needs the previous one's state:
the demo model is registered and served on a Ray node, multicast to the second node; the
node running eight streams is removed mid-stream: they go on on the other node from the next
token, each to exactly its max_tokens, none failed; the node leaves /admin/cluster and the next
request is served by the other node with the same greedy answer; a node added while serving gets an agent, gets the
model by multicast and serves it; its agent process killed, Ray restarts the actor and the service reconnects to the new
agent.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is in the `cluster` extra (scripts/setup.sh installs it)")
openai = pytest.importorskip("openai")

from test_node_loss_e2e import STREAMS, Streams, assert_complete  # noqa: E402 - after the skips when Ray is missing
from test_service_e2e import Server  # noqa: E402 - likewise

pytestmark = [pytest.mark.slow, pytest.mark.shared_processes]  # the module's Ray cluster keeps its workers


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "MESH_DATA_DIR")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep Ray on 127.0.0.1
    os.environ["MESH_DATA_DIR"] = str(tmp_path_factory.mktemp("nodes"))  # the agents' weights folders
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def nodes(server: Server) -> dict[str, dict]:
    return {n["node_id"]: n for n in server.admin("GET", "/admin/cluster")["nodes"]}


def wait_for(predicate, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def ray_node_of(cluster, mesh_node: str):
    """The cluster_utils node whose Ray node id the Mesh node id names (ray-<first 8 hex>)."""
    (node,) = [n for n in cluster.worker_nodes if mesh_node == f"ray-{n.node_id[:8]}"]
    return node


def agent_pid(node_id: str) -> int:
    """The pid of the node agent process of `node_id` (all "machines" are this one)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mesh.agent" in argv and node_id.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no agent process for {node_id}")


def test_ray_cluster_serves_moves_and_grows(ray_cluster, tmp_path, demo_gguf):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server = Server(tmp_path / "data", allowed, tmp_path / "server.log", extra=("--ray", ray_cluster.address))
    server.start(timeout=240)
    try:
        # Two agents, one per worker (the head offers no CPU), each probed on its node.
        up = wait_for(lambda: (v := nodes(server)) and len(v) == 2 and all(n["state"] == "up" for n in v.values())
                      and v, "two node agents up")
        workers = {f"ray-{n.node_id[:8]}" for n in ray_cluster.worker_nodes}
        assert set(up) == workers
        assert all(n["kind"] == "cpu" and n["memory"]["capacity_bytes"] > 0 and n["location"].startswith("ray node")
                   for n in up.values())

        client = server.client()
        ask = dict(model="demo/smollm2", messages=[{"role": "user", "content": "Name three colours."}],
                   max_tokens=12, temperature=0)
        before = client.chat.completions.create(**ask).choices[0].message.content
        weights = server.admin("GET", "/admin/cluster")["weights"]["models"]
        (model,) = weights.values()
        # the first host copy came from the origin by the weights transport; the demo's warm
        # instance may be on either node (the policy's choice), the second one by multicast
        assert model["transfers"][0]["sources"] == ["origin"]
        (first,) = model["transfers"][0]["completed"]
        other = (workers - {first}).pop()

        # Multicast to the second node, which serves it.
        scaled = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2", "nodes": [other]})
        (result,) = scaled["results"]
        assert result["ok"], scaled
        (model,) = server.admin("GET", "/admin/cluster")["weights"]["models"].values()
        # it got there by multicast from the first copy (when the demo was described or warmed
        # up there, or now), never from the origin
        assert any(t["sources"] == [first] and other in t["completed"] for t in model["transfers"]), model
        copy = Path(model["copies"][other])
        assert copy.read_bytes() == demo_gguf.read_bytes()

        # A node removed mid-stream, eight streams on it: they go on on the other node from
        # the next token, each to exactly its max_tokens, none failed.
        streams = Streams(server)
        streams.wait_chunks(4)
        busy = wait_for(lambda: [n for n, v in nodes(server).items() if any(i["active"] for i in v["instances"])],
                        "the node running the streams")
        (serving,) = busy
        assert all(r["finish"] is None for r in streams.results)  # mid-stream
        ray_cluster.remove_node(ray_node_of(ray_cluster, serving))
        assert_complete(streams.join())
        d = server.admin("GET", "/admin/cluster")["dispatcher"]
        assert sum(d["resumed"].values()) == STREAMS and sum(d["lost_failed"].values()) == 0 and d["failed"] == {}, d
        survivor = (workers - {serving}).pop()
        wait_for(lambda: set(nodes(server)) == {survivor}, "the removed node to leave /admin/cluster", 30)
        pool = server.admin("GET", "/admin/cluster")["weights"]["models"]
        assert all(serving not in m["host_copies"] and serving not in m["instances"].values() for m in pool.values())
        # The next request is served by the other node, with the same greedy answer.
        assert client.chat.completions.create(**ask).choices[0].message.content == before
        assert [i["model"] for i in nodes(server)[survivor]["instances"]] == ["demo/smollm2"]

        # A node added while serving gets an agent and the model by multicast, and serves it.
        added = ray_cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        new = f"ray-{added.node_id[:8]}"
        wait_for(lambda: nodes(server).get(new, {}).get("state") == "up", "the added node's agent", 120)
        scaled = server.admin("POST", "/admin/scale", {"tenant": "demo", "model": "demo/smollm2", "nodes": [new]})
        (result,) = scaled["results"]
        assert result["ok"] and result["weights"] == f"multicast from {survivor}", scaled
        ray_cluster.remove_node(ray_node_of(ray_cluster, survivor))  # only the new node is left to serve
        wait_for(lambda: set(nodes(server)) == {new}, "the survivor to leave", 30)
        assert client.chat.completions.create(**ask).choices[0].message.content == before
        assert [i["weights"] for i in nodes(server)[new]["instances"]] == [f"multicast from {survivor}"]

        # Its agent process dies: the actor exits, Ray restarts it (a new agent on a new port),
        # and the service reconnects through the actor's new address.
        location = nodes(server)[new]["location"]
        os.kill(agent_pid(new), signal.SIGKILL)
        wait_for(lambda: nodes(server)[new]["restarts"] >= 1 and nodes(server)[new]["state"] == "up",
                 "Ray to restart the agent and the service to reconnect", 120)
        assert nodes(server)[new]["location"] == location  # the same Ray node
        assert client.chat.completions.create(**ask).choices[0].message.content == before
    finally:
        assert server.stop() == 0
