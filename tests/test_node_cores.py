"""Each node owns its cores (issue 31 item 1): the split of the machine's cores among the
local nodes that compute on them, the operator's own sets, and a real agent process that
runs, probes and reports on its set."""
from __future__ import annotations

import asyncio
import os

import pytest

from mesh.control.supervisor import SERVICE, core_shares, parse_node_cores


def test_cores_split_evenly_and_one_is_kept_for_the_service_where_each_node_still_gets_two():
    assert core_shares(["cpu-0", "cpu-1"], [0, 1]) == {"cpu-0": (0,), "cpu-1": (1,)}  # no core to spare
    assert core_shares(["cpu-0", "cpu-1"], list(range(4))) == {"cpu-0": (0, 1), "cpu-1": (2, 3)}
    assert core_shares(["cpu-0", "cpu-1"], list(range(16))) == {
        SERVICE: (15,), "cpu-0": (0, 1, 2, 3, 4, 5, 6), "cpu-1": (7, 8, 9, 10, 11, 12, 13, 14)}
    assert core_shares(["cpu-0", "cpu-1", "vllm-cpu-0"], [0, 1]) == {
        "cpu-0": (0,), "cpu-1": (1,), "vllm-cpu-0": (0,)}  # more nodes than cores: shared round-robin
    assert core_shares([], [0, 1]) == {}
    shares = core_shares(["a", "b", "c"], list(range(7)))
    owned = [c for k, v in shares.items() for c in v]
    assert sorted(owned) == list(range(7)) and len(owned) == len(set(owned))  # each core once


def test_the_operator_sets_the_cores_by_position_or_by_name():
    nodes = ["cpu-0", "cpu-1", "vllm-cpu-0"]
    allowed = set(range(8))
    assert parse_node_cores("0;1", nodes, allowed) == {"cpu-0": (0,), "cpu-1": (1,)}
    assert parse_node_cores("cpu-1=4-6,0; service=7", nodes, allowed) == {"cpu-1": (0, 4, 5, 6), SERVICE: (7,)}
    for bad, says in [("0;1;2;3", "4 core sets for 3"), ("cpu-9=1", "no local node 'cpu-9'"),
                      ("cpu-0=1;2", "name every set"), ("cpu-0=x", "'x' is not a core"),
                      ("cpu-0=12", "may not use"), (" ; ", "separated by ';'"), ("cpu-0=", "has no cores")]:
        with pytest.raises(ValueError, match=says):
            parse_node_cores(bad, nodes, allowed)


@pytest.mark.slow
def test_a_real_agent_runs_probes_and_reports_on_its_own_core(tmp_path):
    """`python -m mesh.agent --cpus C`: the agent process is pinned to C, its speed probe ran
    there and records it, and its learnt view and hello say so."""
    from mesh.control.supervisor import AgentSettings, LocalAgent
    from mesh.policy.node_spec import NodeSpec

    core = max(os.sched_getaffinity(0))

    async def main() -> None:
        agent = LocalAgent(NodeSpec("cpu-0", "cpu", 2**30), lambda a: None, lambda a, why: None, lambda a, m: None,
                           AgentSettings(cores={"cpu-0": (core,)}))
        await agent.start()
        try:
            assert await agent.wait_up(120), agent.last_error
            assert os.sched_getaffinity(agent.process.pid) == {core}
            stats: dict = {}

            async def probed() -> bool:
                stats.update(await agent.client.call_message({"t": "stats"}, 30))
                return stats["learnt"]["speed"] is not None

            for _ in range(300):
                if await probed():
                    break
                await asyncio.sleep(0.2)
            assert stats["learnt"]["speed"]["cores"] == [core] and stats["learnt"]["speed"]["threads"] == 1
            assert stats["learnt"]["cores"] == [core]
            hello = await agent.client.call_message({"t": "hello", "token": agent.token}, 10.0)
            assert hello["cpu"]["core_set"] == [core]
        finally:
            await agent.stop()

    asyncio.run(main())


def test_the_mixed_rig_is_cpu_nodes_given_with_emulated_gpu_devices():
    from mesh.service.config import ConfigError, build_config

    mixed = build_config({}, {"cpu_nodes": 2, "emulate": "a100-80gb:1", "demo": True})
    assert mixed.mixed_rig and mixed.cold_start_s == 7.5  # its CPU nodes are real: their cold start
    assert build_config({"cpu_nodes": 2}, {"emulate": "a100-80gb:1"}).mixed_rig  # from the file too
    emulated = build_config({}, {"emulate": "a100-80gb:1"})
    assert not emulated.mixed_rig and emulated.cold_start_s == 0.0
    assert not build_config({}, {"cpu_nodes": 2}).mixed_rig
    with pytest.raises(ConfigError, match="emulates GPU devices only"):
        build_config({}, {"cpu_nodes": 2, "emulate": "xeon-6462c:1,a100-80gb:1"})
    with pytest.raises(ConfigError, match="drop --demo, or give cpu_nodes"):
        build_config({}, {"emulate": "a100-80gb:1", "demo": True})
    with pytest.raises(ConfigError, match="node_cores must be core sets"):
        build_config({"node_cores": 3}, {})


def test_a_load_client_on_the_service_machine_moves_to_the_services_cores():
    """mesh replay --live: where the service keeps cores off its nodes' (it reports them at
    /admin/cluster), a client on the same machine runs there; a remote service's are not ours."""
    import json
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    probe = ("import json, os, sys; from mesh.commands.replay_live import _beside_the_service as b; "
             "b(sys.argv[1], (int(sys.argv[2]),)); print(json.dumps(sorted(os.sched_getaffinity(0))))")
    run = lambda url: json.loads(subprocess.run([sys.executable, "-c", probe, url, str(cores[-1])], check=True,  # noqa: E731 - a local shorthand
                                                capture_output=True, text=True, timeout=60).stdout)
    assert run("http://127.0.0.1:8000") == [cores[-1]]
    assert run("http://10.1.2.3:8000") == cores
