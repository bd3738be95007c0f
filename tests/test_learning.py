"""Issue 23 items 4 and 5: the speed probe's factors, warm starts of iteration times, the
per-node learning, the twin's learnt profile and the live replay's learnt catalog."""
from __future__ import annotations

import pytest

from mesh.bench.learning import Iteration, learning_figures, window_errors, within_after
from mesh.commands.replay_live import BASE, learnt_twin
from mesh.control.fleet import ModelSpec
from mesh.node.node_learning import NodeLearning
from mesh.perf.speed import PROBE_MAX, PROBE_MIN, MachineSpeed, SpeedFactors
from mesh.perf.times import AdaptiveTimes, DefaultCpuTimes, learnt_profile, prior_profile
from mesh.policy.batching import IterationKind
from mesh.service.routes_learnt import summarize_kind

DEMO = 98_362_432


def test_speed_factors_scale_inversely_and_are_bounded() -> None:
    ref = MachineSpeed(40.0, 20.0)
    assert SpeedFactors.against(MachineSpeed(20.0, 10.0), ref) == SpeedFactors(2.0, 2.0)
    assert SpeedFactors.against(MachineSpeed(80.0, 40.0), ref) == SpeedFactors(0.5, 0.5)
    slow = SpeedFactors.against(MachineSpeed(0.1, 0.1), ref)
    assert (slow.prefill, slow.decode) == (PROBE_MAX, PROBE_MAX)
    assert SpeedFactors.against(MachineSpeed(1e6, 0.0), ref) == SpeedFactors(PROBE_MIN, 1.0)  # no figure: no scaling


def test_adaptive_times_start_and_warm_start() -> None:
    base = DefaultCpuTimes()
    t = AdaptiveTimes(base, start=(3.0, 2.0))
    assert t.prefill_s(100) == pytest.approx(3.0 * base.prefill_s(100))
    assert t.decode_s(4, 200) == pytest.approx(2.0 * base.decode_s(4, 200))
    for _ in range(40):
        t.observe(IterationKind.DECODE, t.decode_s(4, 200), 2.5 * base.decode_s(4, 200), 4, 200)
    assert t.margin is not None
    nxt = AdaptiveTimes(base)
    nxt.warm_start(t)
    assert nxt.decode_s(4, 200) == pytest.approx(t.decode_s(4, 200)) and nxt.margin == t.margin


def test_node_learning_starts_new_models_from_what_the_node_learnt() -> None:
    learning = NodeLearning()
    learning.set_speed(MachineSpeed(1.0, 1.0))  # far slower than the prior's machine: the probe's bound
    first = learning.adopt("a", AdaptiveTimes(DefaultCpuTimes()))
    assert (first.prefill_factor, first.decode_factor) == (PROBE_MAX, PROBE_MAX)
    for _ in range(40):  # the first model's instance learns the machine is 3x the prior
        first.observe(IterationKind.DECODE, first.decode_s(2, 100), 3 * DefaultCpuTimes().decode_s(2, 100), 2, 100)
    assert first.decode_factor == pytest.approx(3.0, rel=0.05)
    again = learning.adopt("a", AdaptiveTimes(DefaultCpuTimes()))  # the same model's next instance: its state
    assert again.decode_factor == first.decode_factor and again.observed == first.observed
    other = learning.adopt("b", AdaptiveTimes(DefaultCpuTimes.for_weights(4 * DEMO)))  # a new model: the node's
    assert other.decode_factor == pytest.approx(first.decode_factor) and other.observed == 0
    view = learning.view()
    assert view["models"]["a"]["base"] == "prior" and view["models"]["b"]["time_factors"]["observed"] == 0


def test_learnt_profile_applies_region_factors_else_instance_wide() -> None:
    p = prior_profile("m", "cpu", DEMO, 9216, 2048)
    q = learnt_profile(p, {"prefill": 2.0, "decode": 3.0, "prefill_regions": {"64": 4.0},
                           "decode_regions": {"2x64": 5.0}})
    ratios = {n: b / a for n, a, b in zip(p.prefill_lengths, p.prefill_s, q.prefill_s)}
    assert ratios[64] == pytest.approx(4.0) and ratios[16] == pytest.approx(2.0) and ratios[2048] == pytest.approx(2.0)
    b2, c64 = p.decode_batches.index(2), p.decode_contexts.index(64)
    assert q.decode_s[b2][c64] / p.decode_s[b2][c64] == pytest.approx(5.0)
    assert q.decode_s[0][0] / p.decode_s[0][0] == pytest.approx(3.0)


def test_summary_and_twin_use_what_was_learnt() -> None:
    views = [{"models": {"a": {"time_factors": {"prefill": 2.0, "decode": 4.0, "observed": 300, "margin": 0.2,
                                                "prefill_regions": {"64": 2.0}, "decode_regions": {}}},
                         "b": {"time_factors": {"prefill": 2.0, "decode": 1.0, "observed": 100, "margin": 0.4,
                                                "prefill_regions": {}, "decode_regions": {}}}}}]
    # the loads the service measured on the kind's nodes: builds, and adoptions of parked workers
    s = summarize_kind(views, [1.0, 3.0, 2.0], [0.01, 0.03])
    assert s["decode"] == pytest.approx(4.0 ** 0.75, rel=1e-3) and s["prefill"] == pytest.approx(2.0)
    assert s["margin"] == pytest.approx(0.25) and s["cold_start_s"] == 2.0 and s["observed"] == 400
    assert s["parked_load_s"] == pytest.approx(0.02) and s["parked_loads"] == 2
    p = prior_profile(BASE, "cpu", DEMO, 9216, 2048)
    twin = learnt_twin({BASE: ModelSpec(BASE, {"cpu": p})}, {"summary": {"cpu": s}})
    assert twin.margin == pytest.approx(0.25) and twin.cold_start_s == 2.0 and twin.parked_s == pytest.approx(0.02)
    assert twin.catalog[BASE].profiles["cpu"].decode_s[0][0] == pytest.approx(p.decode_s[0][0] * s["decode"])
    none = learnt_twin({BASE: ModelSpec(BASE, {"cpu": p})}, {})
    assert none.catalog[BASE].profiles["cpu"] == p and none.margin is None
    assert none.cold_start_s is None and none.parked_s is None


def test_learning_figures_count_iterations_until_within_10_percent() -> None:
    base = DefaultCpuTimes()
    its = [Iteration(IterationKind.DECODE, 2, 100.0, 3.0 * base.decode_s(2, 100)) for _ in range(120)]
    figures = learning_figures(its, {"prior": (1.0, 1.0), "exact": (1.0, 3.0)}, DEMO)
    assert figures["exact"]["within_10pct_after"] == 0
    prior_n = figures["prior"]["within_10pct_after"]
    assert prior_n is not None and 5 < prior_n < 60  # geometric learning from 3x off, not at once
    assert within_after(window_errors([1.0] * 10, [2.0] * 10)) is None


def test_a_cpu_agent_probes_its_machine_in_a_process_of_its_own() -> None:
    """The probe runs as `python -m mesh.node.speed_probe` (its BLAS threads never share the
    agent's process) and its figures reach the agent's learning."""
    import asyncio

    from mesh.node.agent_server import AgentServer
    from mesh.policy.node_spec import NodeSpec

    async def main():
        agent = AgentServer(NodeSpec("cpu-0", "cpu", 10**9), "token")
        await agent.serve("127.0.0.1:0")
        try:
            for _ in range(600):
                if agent.learning.speed is not None:
                    break
                await asyncio.sleep(0.1)
            return agent.learning.speed, agent.learning.factors
        finally:
            await agent.close()

    speed, factors = asyncio.run(main())
    assert speed is not None and speed.gemm_gflops > 0 and speed.stream_gbps > 0 and speed.threads >= 1
    assert 0.5 <= factors.prefill <= 4.0 and 0.5 <= factors.decode <= 4.0


def test_slowness_no_iteration_confirms_fades_back_to_the_start() -> None:
    """A node that learnt a slowdown under other jobs' load and then runs nothing (its
    admissions, driven by that slowdown, refuse everything) forgets it: after RELAX_AFTER_S
    without an iteration the factors halve their log distance to the start every
    RELAX_HALF_LIFE_S; an iteration stops the fading and teaches again."""
    from mesh.perf.times import RELAX_AFTER_S, RELAX_HALF_LIFE_S

    base = DefaultCpuTimes()
    times = AdaptiveTimes(base, start=(1.5, 1.5))
    times.relax(0.0)  # nothing learnt yet: nothing to forget
    assert times.prefill_factor == times.decode_factor == 1.5 and times.start == (1.5, 1.5)
    for k in range(40):  # 8x slower than predicted, under load
        times.observe(IterationKind.PREFILL, times.prefill_s(158), 8 * times.prefill_s(158), 1, 158, at_s=k * 0.1)
        times.observe(IterationKind.DECODE, times.decode_s(1, 200), 8 * times.decode_s(1, 200), 1, 200, at_s=k * 0.1)
    learnt = times.prefill_factor, times.decode_factor, times.prefill_s(158)
    assert min(learnt[:2]) > 6
    last = 3.9
    times.relax(last + RELAX_AFTER_S - 1)
    assert (times.prefill_factor, times.decode_factor, times.prefill_s(158)) == learnt  # a pause between requests
    times.relax(last + RELAX_AFTER_S + RELAX_HALF_LIFE_S)
    assert times.prefill_factor == pytest.approx(1.5 * (learnt[0] / 1.5) ** 0.5)
    assert times.decode_factor == pytest.approx(1.5 * (learnt[1] / 1.5) ** 0.5)
    assert times.prefill_s(158) < 0.6 * learnt[2]  # the region learnt fades too
    times.relax(last + RELAX_AFTER_S + RELAX_HALF_LIFE_S)  # the same time again: no second step
    assert times.prefill_factor == pytest.approx(1.5 * (learnt[0] / 1.5) ** 0.5)
    times.relax(last + RELAX_AFTER_S + 10 * RELAX_HALF_LIFE_S)
    assert times.prefill_factor == pytest.approx(1.5, rel=0.01)
    before = times.decode_factor
    times.observe(IterationKind.DECODE, times.decode_s(1, 200), 4 * times.decode_s(1, 200), 1, 200, at_s=500.0)
    assert times.decode_factor > before
    after = times.decode_factor
    times.relax(500.0 + RELAX_AFTER_S - 1)
    assert times.decode_factor == after  # fresh evidence holds again


def test_factors_set_without_an_iteration_fade_from_the_first_relax() -> None:
    """An instance that starts from slow factors learnt by others (NodeLearning.adopt) and
    has run nothing fades toward the node's probed speed, counted from its first relax()."""
    from mesh.perf.times import RELAX_AFTER_S, RELAX_HALF_LIFE_S

    learning = NodeLearning()
    slow = learning.adopt("other", AdaptiveTimes(DefaultCpuTimes()))
    for k in range(40):
        slow.observe(IterationKind.DECODE, slow.decode_s(1, 200), 8 * slow.decode_s(1, 200), 1, 200, at_s=k * 0.1)
    fresh = learning.adopt("m", AdaptiveTimes(DefaultCpuTimes()))
    assert fresh.decode_factor > 6 and fresh.start == (learning.factors.prefill, learning.factors.decode)
    fresh.relax(100.0)
    fresh.relax(100.0 + RELAX_AFTER_S + 20 * RELAX_HALF_LIFE_S)
    assert fresh.decode_factor == pytest.approx(learning.factors.decode, rel=0.01)
