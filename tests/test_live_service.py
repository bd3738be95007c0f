"""Live scaling inside the service, on emulated nodes (docs/multicast.md, "Live scaling in
`mesh serve`"): a scale-out under load whose weights arrive by multicast serves from the
new instance before its last block is in, by the twin's rules (mesh.control.load_timing,
mesh.policy.live_scaling), and every request completes.

Real node agents (`python -m mesh.agent --emulate a100-80gb`) under the service's cluster
control, `sllm` (one instance per GPU, scale-out on queued work, as the bursty replay of
docs/multicast.md), a 13B model whose multicast is paced to take about 4 s.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from mesh.control.load_timing import EmulatedLoad, WeightsConfig
from mesh.control.supervisor import AgentSettings
from mesh.engines.emulation import emulated_nodes
from mesh.engines.engine_api import Sampling
from mesh.policy.slo import SLO
from mesh.service.cluster_control import ClusterControl, ClusterSettings
from mesh.service.registry import ModelRecord
from mesh.service.streams import Job
from mesh.wire.served_request import Outcome, ServedRequest

MODEL = "llama-2-13b"
NET_BYTES_PER_S = 6.5e9  # 13B's 26 GB in about 4 s
BURST = 40  # sllm's target for 13B on a GPU is 16 requests an instance: two scale-outs


async def serve_burst(live: bool) -> dict[str, Any]:
    """One request (the first instance), then a burst; what each load was told and each
    request's outcome, instance and first token (the control's clock)."""
    nodes, devices = emulated_nodes("a100-80gb:3")
    weights = WeightsConfig("multicast-live" if live else "multicast", net_bytes_per_s=NET_BYTES_PER_S)
    settings = ClusterSettings(policy="sllm", keep_alive_s=60.0, cold_start_s=0.0, emulated_weights=weights,
                               agent=AgentSettings(emulate=devices, emulate_noise=0.0))
    control = ClusterControl(nodes, settings)
    record = ModelRecord("u-live", "t", "live", "emulated", MODEL, 4096, SLO())
    loop = asyncio.get_running_loop()
    loads: dict[str, tuple[float, EmulatedLoad]] = {}  # instance -> (issued at, its load)
    emulated_load = control.catalogue.emulated_loads.load

    def spy(plan: Any, node: Any) -> EmulatedLoad:
        load = emulated_load(plan, node)
        loads[plan.instance_id] = (loop.time(), load)
        return load

    control.catalogue.emulated_loads.load = spy  # type: ignore[method-assign]
    submitted: list[ServedRequest] = []
    dispatcher_submit = control.dispatcher.submit
    control.dispatcher.submit = lambda req: (submitted.append(req), dispatcher_submit(req))[1]  # type: ignore

    async def one(i: int) -> None:
        job = Job(f"r{i:03d}", record, loop.time(), Sampling(max_tokens=48, ignore_eos=True),
                  prompt_token_ids=[100 + (i * 31 + k) % 3000 for k in range(200)])
        stream = await control.submit(job)
        async for _event in stream.events():
            pass

    await control.start()
    try:
        await control.catalogue.described(record)
        await asyncio.wait_for(one(0), 60)
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1, BURST + 1))), 120)
        stats = {}
        for node in control.pool.nodes():
            await node.refresh()
            stats[node.node_id] = node.stats
        timing = control.catalogue.emulated_loads.timing
        return {"loads": loads, "requests": list(submitted), "stats": stats,
                "timing": dict(timing.stats.loads) if timing is not None else {}}
    finally:
        await control.stop()


@pytest.mark.timeout(300)
def test_a_scale_out_under_load_serves_from_the_loading_instance_before_its_last_block():
    run = asyncio.run(serve_burst(live=True))
    requests: list[ServedRequest] = run["requests"]
    assert len(requests) == BURST + 1
    assert all(r.outcome is Outcome.COMPLETED for r in requests), [(r.request_id, r.detail) for r in requests
                                                                   if r.outcome is not Outcome.COMPLETED]
    live = {iid: load for iid, load in run["loads"].items() if load[1].layer_steps}
    assert run["timing"].get("live", 0) >= 1 and live, run["timing"]
    early = []
    for iid, (issued, load) in live.items():
        last_block = issued + load.load_s  # its last layer is in
        assert load.partner is not None and load.layer_steps[0][0] < 0.25 * load.load_s  # serves from its first layers
        early += [r for r in requests if r.instance_id == iid and r.first_token_s is not None
                  and r.first_token_s < last_block]
    assert early, "no request got its first token from a live instance before its last block"
    counts = [s.get("live", {}) for s in run["stats"].values()]
    pulls, lent = sum(c.get("pulls", 0) for c in counts), sum(c.get("lent", 0) for c in counts)
    assert pulls >= 1 and pulls == lent, counts  # the partner finished the live instance's iterations
    assert sum(c.get("late_for_layers", 0) for c in counts) == 0, counts
    print(f"live loads {len(live)}, first tokens before the last block {len(early)}, pulls {pulls}, "
          f"counts {counts}")


# ---- the pieces, fast ---------------------------------------------------------------------------

def test_a_partner_lends_its_node_time_only_when_idle_and_sooner_than_the_target_alone():
    """mesh.node.lending.Lender decides as the twin's partner does (source_pull, lend_helps):
    not while a request of its own waits for prefill, not when the target alone would end
    sooner; a lend reserves its node's time, which its next iteration then waits for."""
    from types import SimpleNamespace

    from mesh.engines.emulated import WallPace
    from mesh.engines.emulation import Emulation
    from mesh.engines.engine_api import EngineRequest
    from mesh.node.lending import Lender
    from mesh.node.live_counts import LiveCounts
    from mesh.policy.live_scaling import pulled_finish
    from mesh.wire.layers import Lend

    async def main() -> None:
        engine = Emulation("a100-80gb", noise=0.0, pace=WallPace()).engine("p", MODEL, "u", 4096, 64, 0.0)
        counts = LiveCounts()
        lender = Lender({"p": SimpleNamespace(engine=engine, loaded=True)}, counts)
        ask = Lend("p", 10, 40, 0.2, 0.001, 1.0)
        assert not lender.lend(Lend("q", 10, 40, 0.2, 0.001, 1.0)).lent  # no such instance
        engine.add_request(EngineRequest("own", 50, Sampling(max_tokens=4), list(range(50))))
        busy = lender.lend(ask)
        assert not busy.lent and "prefill" in busy.why
        await engine.step()  # its prefill: nothing of its own waits now
        assert not lender.lend(Lend("p", 10, 40, 0.2, 0.001, 0.05)).lent  # the target alone is sooner
        loop = asyncio.get_running_loop()
        now = loop.time()
        free = engine.pace.free_at(now)
        lent = lender.lend(ask)
        assert lent.lent and counts.lent == 1
        assert lent.after_s == pytest.approx(pulled_finish(now, 0.2, 10, 40, free, 0.001) - now, abs=0.01)
        before = loop.time()
        await engine.step()  # its own decode waits for the lent time
        assert loop.time() - before >= lent.after_s - 0.01

    asyncio.run(main())


def test_emulate_weights_is_a_checked_config_key():
    from mesh.service.config import ConfigError, build_config

    assert build_config({}, {"emulate": "a100-80gb:2", "emulate_weights": "multicast-live"}).emulate_weights == \
        "multicast-live"
    assert build_config({}, {}).emulate_weights == "cached"
    with pytest.raises(ConfigError, match="emulate_weights"):
        build_config({}, {"emulate": "a100-80gb:2", "emulate_weights": "pigeon"})
