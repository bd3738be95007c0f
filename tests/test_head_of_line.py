"""No head-of-line blocking across models (issue 32 item 3): one model's scale-out, whose
weights cross a paced link for seconds, holds neither its model's placement decision nor
the queue behind it, so another model's waiting requests are placed at once.

Real parts: the service's cluster control and dispatcher, node agents (in this process, behind
real loopback connections), the weights plane multicasting a 1 GiB model over a node's
uplink paced to 128 MiB/s (mesh.weights.peer's Pacer, as `--link-mbps` paces it). The
engines are simulated (no model to run: the test is about placement), the model file is
sparse (its bytes cost no disk to read; the copies on the nodes are written in full).
`MESH_HOL_BYTES` sets the model's size (default 1 GiB)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from agent_doubles import WEIGHTS_TOKEN, InProcessAgent, use_simulated_engines
from mesh.control.weights_plane import WeightsPlane, WeightsSettings
from mesh.engines.engine_api import Sampling
from mesh.policy.node_spec import NodeSpec
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.registry import ModelRecord
from mesh.service.streams import Finished, Job

pytestmark = pytest.mark.slow

BIG = int(os.environ.get("MESH_HOL_BYTES", str(2**30)))
LINK_BYTES_PER_S = 128 * 2**20  # a 1 GiB scale-out takes 8 s on this link
SMALL = 2**20
QUEUED_B = 4  # model B's requests waiting behind model A's


@pytest.fixture(autouse=True)
def simulated(monkeypatch):
    use_simulated_engines(monkeypatch)


def test_a_paced_scale_out_of_one_model_does_not_delay_another_models_queue(tmp_path: Path):
    big, small = tmp_path / "registry" / "a.gguf", tmp_path / "registry" / "b.gguf"
    big.parent.mkdir()
    with open(big, "wb") as f:  # sparse: its blocks read as zeros
        f.truncate(BIG)
    small.write_bytes(os.urandom(SMALL))
    # A may wait out its scale-out (its TTFT SLO covers it); B's is the default 2 s
    a = ModelRecord("m_a", "t", "a", "gguf", str(big), 256, SLO(ttft_min_s=600.0), BIG)
    b = ModelRecord("m_b", "t", "b", "gguf", str(small), 256, SLO(), SMALL)

    class Agent(InProcessAgent):
        weights_root = str(tmp_path / "nodes")
        link_bytes_per_s = LINK_BYTES_PER_S

    # cpu-0 holds the first host copies and can run nothing (its memory is for weights only):
    # every instance runs on cpu-1, whose copy of A crosses cpu-0's paced uplink
    specs = [NodeSpec("cpu-0", "cpu", 10**5), NodeSpec("cpu-1", "cpu", 10**10)]
    plane = WeightsSettings(plan="binomial", block_bytes=16 << 20, token=WEIGHTS_TOKEN)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        p = ClusterControl(specs, ClusterSettings(cold_start_s=0.0), agent_factory=Agent,
                             weights=lambda agents: WeightsPlane(agents, plane, {"cpu-0": 4 * BIG, "cpu-1": 4 * BIG}))
        await p.start()
        try:
            for record in (a, b):
                await p.weights.register(record)
                await p.catalogue.described(record)
            assert p.weights.holders(a.uid) == ["cpu-0"]

            def job(record: ModelRecord, rid: str) -> Job:
                return Job(rid, record, loop.time(), Sampling(max_tokens=2), prompt_token_ids=list(range(1, 11)))

            async def served(record: ModelRecord, rid: str) -> float:
                """When the request was admitted on a node (its stream started); it completes."""
                stream = await p.submit(job(record, rid))
                admitted = loop.time()
                events = [e async for e in stream.events()]
                assert isinstance(events[-1], Finished), events
                return admitted

            await served(b, "b-warm")  # B's instance runs on cpu-1 (its small copy crossed the link)

            # A's request, then B's, wait in the queue (placement refused while they arrive)
            place = p.dispatcher.policy.place

            async def refuse(req, now, avoid=frozenset()):
                return False

            p.dispatcher.policy.place = refuse
            a_task = asyncio.ensure_future(served(a, "a-1"))
            await asyncio.sleep(0.05)
            b_tasks = [asyncio.ensure_future(served(b, f"b-{i}")) for i in range(QUEUED_B)]
            for _ in range(100):
                if len(p.dispatcher.queue) == 1 + QUEUED_B:
                    break
                await asyncio.sleep(0.01)
            assert [r.model for r in p.dispatcher.waiting_requests()] == [a.uid] + [b.uid] * QUEUED_B
            p.dispatcher.policy.place = place

            freed = loop.time()
            p.dispatcher.capacity_freed()  # the queue drains: A's scale-out first in line
            b_delays = [await task - freed for task in b_tasks]
            a_delay = await a_task - freed
            a_ready = max(0.0, loop.time() - freed)
            transfer_s = BIG / LINK_BYTES_PER_S
            a_instance = [i for n in p.view()["nodes"] for i in n["instances"] if i["model"] == "a"]
            print(f"A's scale-out: {BIG / 2**30:.2f} GiB at {LINK_BYTES_PER_S / 2**20:.0f} MiB/s ({transfer_s:.1f} s "
                  f"on the link); A's request admitted {a_delay:.2f} s after the drain started, done {a_ready:.2f} s; "
                  f"B's {QUEUED_B} queued requests admitted after {', '.join(f'{d * 1000:.0f}' for d in b_delays)} ms; "
                  f"longest decision {p.dispatcher.stats.decision_max_s * 1000:.0f} ms")
            assert a_instance and a_instance[0]["weights"] == "multicast from cpu-0", a_instance
            assert a_delay >= 0.9 * transfer_s  # A's weights did cross the paced link first...
            assert max(b_delays) <= 0.1, b_delays  # ...while B's queued requests were placed within 100 ms
            assert p.dispatcher.stats.decision_max_s < 0.1 * transfer_s  # no decision held its model for the transfer
        finally:
            await p.stop()

    asyncio.run(main())
