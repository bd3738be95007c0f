"""The cluster dispatcher, rule by rule, on small clusters with hand-checkable profiles
(tests/cluster_doubles.py): CPU first, highest batch first, proactive preemption, cold
start, keep-alive, the bounded queue, ServerlessLLM scale-out, and the accounting."""
import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_doubles import GB, build, config, request, run_until, spec
from mesh.control.schedulers import POLICIES, UnknownScheduler, scheduler_spec
from mesh.perf.load_times import GIB, RESIZE_UP_S_PER_GIB, ColdStart
from mesh.policy.slo import SLO
from mesh.replay.virtual_loop import run_virtual
from mesh.wire.served_request import Outcome

KV0_S = 100_000 * 1024 * 1.2 / GIB * RESIZE_UP_S_PER_GIB  # initial KV cache (L_min = 1024 tokens, w = 0.2)


async def instances(cluster, model: str, batches: dict[str, int], slo: SLO = SLO(), out: int = 500) -> dict:
    """Start an instance of `model` on each node with that many running requests."""
    refs = {}
    for node_id, b in batches.items():
        node = cluster.node(node_id)
        ref = await cluster.start_instance(cluster.plan(model, node), node)
        for k in range(b):
            assert (await node.try_admit(ref.instance_id, request(f"{model}-{node_id}-{k}", model, out=out,
                                                                  slo=slo))).ok
        refs[node_id] = ref
    await asyncio.sleep(1.0)  # loaded, prefilled, decoding
    return refs


def test_new_instance_on_a_cpu_node_first_with_its_cold_start():
    async def main():
        cluster, d = await build("mesh", {"m": "llama-2-7b"}, config(cpu=1, gpu=1))
        r = request("r", "m", prompt=100, out=3)
        d.submit(r)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return r, cluster

    r, cluster = run_virtual(main())
    assert r.outcome is Outcome.COMPLETED and r.node_id == "cpu0"
    # weights already in the CPU node's memory: one pass at 40 GB/s, plus the KV cache, then a 100-token prefill
    assert r.ttft_s == pytest.approx(2 * GB / (40 * GB) + KV0_S + 0.01 + 0.05, abs=1e-6)
    assert cluster.instances_started == 1


def test_gpu_cold_start_over_pcie():
    async def main():
        cluster, d = await build("mesh-no-cpu", {"m": "llama-2-7b"}, config(cpu=1, gpu=1))
        r = request("r", "m", prompt=100, out=3)
        d.submit(r)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return r

    r = run_virtual(main())
    assert r.node_id == "gpu0"
    assert r.ttft_s == pytest.approx(2 * GB / (20 * GB) + KV0_S + 0.06, abs=1e-6)  # host -> GPU at 20 GB/s


@pytest.mark.parametrize("policy, expected", [("mesh", "cpu0"), ("mesh-no-defrag", "cpu1")])
def test_highest_batch_first_among_a_models_instances(policy, expected):
    async def main():
        cluster, d = await build(policy, {"m": "llama-2-7b"}, config(cpu=2, gpu=1))
        refs = await instances(cluster, "m", {"cpu0": 2, "cpu1": 1, "gpu0": 3})
        r = request("r", "m")
        assert await d.policy.place(r, d.now())
        await cluster.stop()
        return r, refs

    r, refs = run_virtual(main())
    assert r.instance_id == refs[expected].instance_id  # CPU before the GPU's batch of 3


# Decode c + d B on the CPU: 0.05 + 0.02 B; one decode round of the node must stay within
# the TPOT SLO with the 10% margin.
SHARED = {"cpu_decode_per_request": 0.02}


def test_proactive_preemption_of_a_lower_batch_neighbour():
    """X (model m, batch 2) and Y (model n, batch 1) share cpu0: (0.09 + 0.07) x 1.1 =
    0.176 s <= TPOT 0.19. A third request for m makes the round (0.11 + 0.07) x 1.1 = 0.198 s:
    X fails validation. Y's request validates on a new instance on gpu0, so Y is preempted,
    the request joins X, and Y's request resumes on gpu0 with its tokens kept (7.1)."""
    slo = SLO(tpot_s=0.19)

    async def main():
        models = {"m": "llama-2-7b", "n": "llama-2-7b"}
        cluster, d = await build("mesh", models, config(cpu=1, gpu=1, slo=slo), {"llama-2-7b": spec(**SHARED)})
        x = (await instances(cluster, "m", {"cpu0": 2}, slo))["cpu0"]
        node = cluster.node("cpu0")
        y = await cluster.start_instance(cluster.plan("n", node), node)
        moved = request("n-0", "n", out=60, slo=slo)
        assert (await node.try_admit(y.instance_id, moved)).ok
        await asyncio.sleep(1.0)
        done_before = node.progress("n-0")
        r = request("r", "m", slo=slo)
        assert not (await node.validate(x.instance_id, r)).ok
        assert await d.policy.place(r, d.now())
        state = (r.instance_id, moved.node_id, moved.tokens_out, y.instance_id in node.instances,
                 d.policy.stats.preemptions)
        await run_until(lambda: moved.outcome is not None)
        await cluster.stop()
        return x, state, done_before, moved

    x, (r_instance, moved_node, carried, y_alive, preemptions), done_before, moved = run_virtual(main())
    assert r_instance == x.instance_id and not y_alive and preemptions == 1
    assert moved_node == "gpu0" and carried == done_before > 0
    assert moved.outcome is Outcome.COMPLETED and moved.tokens_out == 60  # nothing lost, nothing repeated
    assert any("preempted by" in a for a in moved.attempts)


def test_no_preemption_when_the_preempted_requests_cannot_go_elsewhere():
    slo = SLO(tpot_s=0.19)

    async def main():
        models = {"m": "llama-2-7b", "n": "llama-2-7b"}
        cluster, d = await build("mesh", models, config(cpu=1, gpu=0, slo=slo), {"llama-2-7b": spec(**SHARED)})
        await instances(cluster, "m", {"cpu0": 2}, slo)
        await instances(cluster, "n", {"cpu0": 1}, slo)
        placed = await d.policy.place(request("r", "m", slo=slo), d.now())
        left = sorted(i.model for i in cluster.node("cpu0").instances.values())
        await cluster.stop()
        return placed, left, d.policy.stats.preemptions

    placed, left, preemptions = run_virtual(main())
    assert not placed and left == ["m", "n"] and preemptions == 0


def test_preemption_takes_the_lowest_batch_neighbour_first():
    """X batch 3, Y2 batch 2, Y1 batch 1; TPOT 0.3: (0.11 + 0.09 + 0.07) x 1.1 = 0.297 fits, one
    more request on X does not (0.319); preempting Y1 alone is enough (0.242)."""
    slo = SLO(tpot_s=0.3)

    async def main():
        models = {"x": "llama-2-7b", "y2": "llama-2-7b", "y1": "llama-2-7b"}
        cluster, d = await build("mesh", models, config(cpu=1, gpu=1, slo=slo), {"llama-2-7b": spec(**SHARED)})
        await instances(cluster, "x", {"cpu0": 3}, slo)
        await instances(cluster, "y2", {"cpu0": 2}, slo)
        await instances(cluster, "y1", {"cpu0": 1}, slo)
        assert await d.policy.place(request("r", "x", slo=slo), d.now())
        on_cpu = sorted(i.model for i in cluster.node("cpu0").instances.values())
        on_gpu = sorted(i.model for i in cluster.node("gpu0").instances.values())
        await cluster.stop()
        return on_cpu, on_gpu

    on_cpu, on_gpu = run_virtual(main())
    assert on_cpu == ["x", "y2"] and on_gpu == ["y1"]


def test_idle_instances_are_recycled_after_keep_alive():
    async def main():
        cluster, d = await build("mesh", {"m": "llama-2-7b"}, config(cpu=1, gpu=0, keep_alive_s=1.0))
        r = request("r", "m", out=5)
        d.submit(r)
        await run_until(lambda: r.outcome is not None, step_s=0.001)
        loop = asyncio.get_running_loop()
        t_done = loop.time()
        await asyncio.sleep(0.9)
        kept = len(cluster.node("cpu0").instances)
        await asyncio.sleep(0.2)
        gone = len(cluster.node("cpu0").instances)
        d.close()
        await cluster.stop()
        return t_done, kept, gone, cluster

    t_done, kept, gone, cluster = run_virtual(main())
    assert (kept, gone) == (1, 0) and cluster.instances_recycled == 1
    assert cluster.usage[-1][1:] == (0, 0) and cluster.usage[-1][0] == pytest.approx(t_done + 1.0, abs=0.01)


def test_waiting_request_is_rejected_with_a_reason_once_it_cannot_meet_its_slo():
    async def main():
        cluster, d = await build("sllm", {"a": "llama-2-7b", "b": "llama-2-7b"}, config(cpu=0, gpu=1), queue_capacity=1,
                           queue_timeout_s=None)
        hog = request("hog", "a", out=2000)  # holds the only GPU for 100 s
        d.submit(hog)
        waiting = request("b1", "b", prompt=100)
        d.submit(waiting)
        behind = request("b2", "b", prompt=100)
        d.submit(behind)  # model b already waits: queued behind it, and the queue holds one
        await run_until(lambda: waiting.outcome is not None)
        t = asyncio.get_running_loop().time()
        d.close()
        await d.all_done.wait()
        acc = d.accounting()
        await cluster.stop()
        return waiting, behind, t, acc, d

    waiting, behind, t, acc, d = run_virtual(main())
    assert waiting.outcome is Outcome.REJECTED and "cannot meet its SLO" in waiting.detail
    assert t == pytest.approx(2.0 - 0.06, abs=0.06)  # TTFT SLO 2 s minus the fastest prefill, retried every 50 ms
    assert behind.outcome is Outcome.REJECTED and "queue full" in behind.detail
    assert acc == {"requests": 3, "completed": 1, "slo_compliant": 1, "slo_violating": 0, "rejected": 2,
                   "failed": 0, "slo_compliant_strict": 1}
    assert d.stats.rejected == {"cannot meet its SLO": 1, "queue full": 1}


def test_a_tenants_burst_cannot_fill_the_queue_for_another():
    """Queue of 3, one GPU held by a hog: tenant x's burst of four fills it (the fourth is
    refused, x already holds all), then tenant y's request takes the place of x's newest."""

    async def main():
        cluster, d = await build("sllm", {"a": "llama-2-7b", "x": "llama-2-7b", "y": "llama-2-7b"},
                                 config(cpu=0, gpu=1), queue_capacity=3, queue_timeout_s=30.0)
        d.submit(request("hog", "a", out=2000))  # holds the only GPU for 100 s
        burst = [request(f"x{i}", "x") for i in range(4)]
        for r in burst:
            r.tenant = "tx"
            d.submit(r)
        await asyncio.sleep(0.1)
        y = request("y0", "y")
        y.tenant = "ty"
        d.submit(y)
        await asyncio.sleep(0.1)
        waiting = sorted(d._waiting)
        d.abort_all("test over")
        await cluster.stop()
        return burst, y, waiting

    burst, y, waiting = run_virtual(main())
    assert waiting == ["x0", "x1", "y0"]
    assert burst[3].outcome is Outcome.REJECTED and "3 of them its tenant's" in burst[3].detail
    assert burst[2].outcome is Outcome.REJECTED and "another tenant's request took its place" in burst[2].detail


@pytest.mark.parametrize("policy", ["sllm", "mesh-no-share"])
def test_queue_timeout_baselines_serve_late_mesh_turns_away_at_once(policy):
    """Under the default client timeout (30 s) a baseline keeps a hopeless request waiting
    and serves it late; Mesh rejects it once it can no longer meet its SLO."""

    async def main():
        cluster, d = await build(policy, {"a": "llama-2-7b", "b": "llama-2-7b"}, config(cpu=0, gpu=1))
        d.submit(request("hog", "a", out=100))  # 5 s of decoding on the only node
        late = request("b1", "b")
        d.submit(late)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return late, d.accounting()

    late, acc = run_virtual(main())
    if policy == "sllm":
        assert late.outcome is Outcome.COMPLETED and late.ttft_s > 5.0 and acc["slo_violating"] == 1
    else:
        assert late.outcome is Outcome.REJECTED and "cannot meet its SLO" in late.detail
        assert late.finish_s - late.arrival_s == pytest.approx(2.0 - 0.06, abs=0.06)


@pytest.mark.parametrize("admission, timeout", [("reject", 30.0), ("queue", 30.0), ("queue", 3.0), ("late", 3.0)])
def test_admission_choice_of_a_request_that_cannot_meet_its_slo(admission, timeout):
    """Mesh, one GPU held for 5 s: a request of another model cannot meet its SLO. 'reject'
    turns it away at once; 'queue' serves it late once the GPU frees if that is within the
    queue's bound, else turns it away at the bound; 'late' serves it late whatever the bound.
    Served late, it still counts as missing its SLO (judged from its arrival)."""

    async def main():
        cluster, d = await build("mesh-no-share", {"a": "llama-2-7b", "b": "llama-2-7b"},
                                 config(cpu=0, gpu=1, admission="reject"), queue_timeout_s=timeout)
        cluster.set_admission("b", admission)
        d.submit(request("hog", "a", out=100))  # 5 s of decoding on the only node
        late = request("b1", "b")
        applied = d.admission(late)
        d.submit(late)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return late, d.accounting(), applied

    late, acc, applied = run_virtual(main())
    assert applied == admission
    if admission == "reject":
        assert late.outcome is Outcome.REJECTED and "cannot meet its SLO" in late.detail
        assert late.finish_s - late.arrival_s == pytest.approx(2.0 - 0.06, abs=0.06)
    elif admission == "queue" and timeout < 5.0:
        assert late.outcome is Outcome.REJECTED and "queue timeout" in late.detail
        assert late.finish_s - late.arrival_s == pytest.approx(timeout)
    else:
        assert late.outcome is Outcome.COMPLETED and 5.0 < late.ttft_s < 5.5 + 2.0
        assert acc["slo_violating"] == 1 and acc["rejected"] == 0


def test_a_handed_back_request_waits_for_a_node_whatever_its_models_admission():
    """A request evicted mid-stream under the `reject` admission, with the only other GPU
    busy for 10 s: its stream had started, so it waits for a node as a lost one does
    (ADMIT_QUEUE up to the queue timeout) and, once it cannot be on time, is placed best
    effort on the other GPU when that frees: it completes with all its tokens. (Before, it
    failed after its 17 tokens as soon as it could no longer meet its SLO: a stream error.)"""

    async def main():
        cluster, d = await build("mesh-no-share", {"a": "llama-2-7b", "b": "llama-2-7b"},
                                 config(cpu=0, gpu=2, admission="reject"), queue_timeout_s=30.0)
        b1, hog = request("b1", "b", out=100), request("hog", "a", out=200)
        d.submit(b1)
        d.submit(hog)  # 10 s of decoding on the other GPU
        await asyncio.sleep(1.0)
        held, progress = b1.node_id, cluster.node(b1.node_id).progress("b1")
        cluster.node(held).runtime.evict("b1", "a test's eviction")
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return b1, hog, held, progress, d.admission(b1)

    b1, hog, held, progress, applied = run_virtual(main())
    assert held == "gpu0" and hog.node_id == "gpu1" and progress > 0 and applied == "queue"
    assert b1.outcome is Outcome.COMPLETED and b1.tokens_out == 100 and b1.evictions == 1, b1.detail
    assert b1.node_id == "gpu1" and b1.best_effort and b1.finish_s > hog.finish_s


def test_an_instance_its_node_lost_is_not_one_of_its_models_before_the_news_arrives():
    """A node agent killed mid-decision: the node has lost the instance, the cluster's books
    not yet (instance_gone is on its way). The model's instances leave it out, so a placement
    (its warm-up count, the cold start left) does not fail on it: the soak's KeyError, a 503."""

    async def main():
        cluster, d = await build("mesh", {"m": "llama-2-7b"}, config(cpu=1, gpu=0))
        node = cluster.node("cpu0")
        ref = await cluster.start_instance(cluster.plan("m", node), node)
        held = [r.instance_id for r in cluster.instances_of("m")]
        node.runtime.instances.pop(ref.instance_id)  # lost by the node, not yet by the books
        after = cluster.instances_of("m"), cluster.cold_start_left_s("m")
        req = request("r", "m")
        d.submit(req)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return ref.instance_id, held, after, req

    iid, held, (after, left), req = run_virtual(main())
    assert held == [iid] and after == [] and left is None
    assert req.outcome is Outcome.COMPLETED and req.instance_id != iid, req.detail


def test_queue_timeout_rejects_after_waiting():
    async def main():
        cluster, d = await build("sllm", {"a": "llama-2-7b", "b": "llama-2-7b"}, config(cpu=0, gpu=1),
                                 queue_timeout_s=3.0)
        d.submit(request("hog", "a", out=200))  # 10 s
        late = request("b1", "b")
        d.submit(late)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return late, d.stats

    late, stats = run_virtual(main())
    assert late.outcome is Outcome.REJECTED and "queue timeout" in late.detail
    assert late.finish_s - late.arrival_s == pytest.approx(3.0) and stats.rejected == {"queue timeout": 1}


@pytest.mark.parametrize("policy, first, second", [("sllm", "gpu0", "gpu1"), ("sllm+cpu", "cpu0", "gpu0")])
def test_sllm_scales_out_past_the_concurrency_target(policy, first, second):
    target = 32 if first == "gpu0" else 15  # Llama-2-7B on a GPU / on a CPU (8.1)

    async def main():
        cluster, d = await build(policy, {"m": "llama-2-7b"}, config(cpu=1, gpu=2))
        reqs = [request(f"r{k}", "m", out=50) for k in range(target + 1)]
        for r in reqs:
            d.submit(r)
        await asyncio.sleep(0)  # the placements (one task per arrival)
        nodes = [r.node_id for r in reqs]
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return nodes, d.accounting()

    nodes, acc = run_virtual(main())
    assert nodes[:target] == [first] * target and nodes[target] == second
    assert acc["completed"] == target + 1


def test_sllm_gives_each_instance_a_whole_node():
    async def main():
        cluster, d = await build("sllm", {"a": "llama-2-7b", "b": "llama-2-7b"}, config(cpu=1, gpu=2))
        ra, rb = request("ra", "a", out=50), request("rb", "b", out=50)
        d.submit(ra)
        d.submit(rb)
        await asyncio.sleep(0)  # the placements (one task per arrival)
        nodes = (ra.node_id, rb.node_id)
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return nodes

    assert run_virtual(main()) == ("gpu0", "gpu1")  # GPU only; one instance per node


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(UnknownScheduler, match="mesh, sllm, sllm\\+cpu, mesh-no-share, mesh-no-cpu, mesh-no-defrag"):
        scheduler_spec("vllm")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    reqs=st.lists(
        st.tuples(st.floats(0, 8), st.integers(0, 3), st.integers(1, 900), st.integers(1, 80)),
        min_size=1, max_size=14,
    ),
    timeout=st.sampled_from([None, 0.5, 20.0]),
)
def test_no_request_is_ever_lost(policy, reqs, timeout):
    """Whatever arrives, every request ends completed, rejected or failed, and is counted."""
    models = {f"m{k}": "llama-2-7b" if k % 2 else "llama-3.2-3b" for k in range(4)}
    catalog = {"llama-2-7b": spec("llama-2-7b", **SHARED), "llama-3.2-3b": spec("llama-3.2-3b")}

    async def main():
        cluster, d = await build(policy, models, config(cpu=1, gpu=1, slo=SLO(tpot_s=0.2)), catalog,
                           queue_capacity=6, queue_timeout_s=timeout)
        loop = asyncio.get_running_loop()
        served = []
        for k, (at, m, prompt, out) in enumerate(sorted(reqs)):
            await asyncio.sleep(max(0.0, at - loop.time()))
            r = request(f"r{k}", f"m{m}", prompt=prompt, out=out, slo=SLO(tpot_s=0.2))
            served.append(r)
            d.submit(r)
        d.close()
        await asyncio.wait_for(d.all_done.wait(), 3600)
        acc = d.accounting()
        await cluster.stop()
        return served, acc

    served, acc = run_virtual(main())
    assert all(r.outcome is not None for r in served)
    assert acc["requests"] == len(reqs) == acc["slo_compliant"] + acc["slo_violating"] + acc["rejected"] + acc["failed"]
    for r in served:
        if r.outcome is Outcome.COMPLETED:
            assert r.tokens_out == r.engine_request.output_len
        else:
            assert r.detail


def test_an_evicted_request_is_rescheduled_on_another_node_with_its_progress():
    """6.4: two long outputs outgrow cpu0's memory (weights + 1300 tokens of KV); the node
    evicts the request with the longest headroom, and the dispatcher places it on cpu1,
    where it resumes after the tokens it already produced."""
    from cluster_doubles import KV_PER_TOKEN, WEIGHTS

    async def main():
        cfg = config(cpu=2, gpu=0, cpu_memory_bytes=WEIGHTS + 1300 * KV_PER_TOKEN)
        cluster, d = await build("mesh", {"m": "llama-2-7b"}, cfg)
        reqs = [request(f"r{k}", "m", prompt=100, out=900) for k in range(2)]
        for r in reqs:
            d.submit(r)
        await asyncio.sleep(0)  # the placements (one task per arrival)
        first_nodes = [r.node_id for r in reqs]
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return reqs, first_nodes, d

    reqs, first_nodes, d = run_virtual(main())
    assert first_nodes == ["cpu0", "cpu0"]
    moved = [r for r in reqs if r.evictions]
    assert len(moved) == 1 and moved[0].node_id == "cpu1" and d.stats.rescheduled == 1
    assert all(r.outcome is Outcome.COMPLETED and r.tokens_out == 900 for r in reqs)


def test_a_crashed_node_loop_is_reported_not_hidden():
    from mesh.replay.simulator import Simulator

    class Broken:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def step(self):
            raise RuntimeError("boom")

    async def main():
        catalog = {"llama-2-7b": spec()}
        simulator = Simulator(config(cpu=1, gpu=0), catalog, {"m": "llama-2-7b"}, {"llama-2-7b": 100.0})
        cluster = simulator.cluster
        simulator.engine_factory = lambda plan, kind, load_s, seed: Broken(simulator.simulated_engine(plan, kind,
                                                                                                      load_s, seed))
        await cluster.start()
        node = cluster.node("cpu0")
        ref = await cluster.start_instance(cluster.plan("m", node), node)
        await node.try_admit(ref.instance_id, request("r", "m"))
        await asyncio.sleep(1.0)
        with pytest.raises(RuntimeError, match="node cpu0: its token-level loop crashed"):
            cluster.check_nodes()
        await cluster.stop()

    run_virtual(main())


def test_loads_on_one_node_queue_behind_each_other():
    """A node loads one instance at a time (ColdStart): a second model started on it while the
    first loads is predicted, and in the simulation is, ready one load later; another node's
    load does not wait. The prediction is what shadow validation counts in a TTFT."""
    load = 2 * GB / (40 * GB)  # llama-2-7b's weights from host memory at 40 GB/s

    async def main():
        cluster, _ = await build("mesh", {"a": "llama-2-7b", "b": "llama-2-7b", "c": "llama-2-7b"},
                                 config(cpu=2, gpu=0))
        cpu0, cpu1 = cluster.node("cpu0"), cluster.node("cpu1")
        first = cluster.plan("a", cpu0)
        assert first.load_wait_s == 0.0 and cluster.load_wait_s(cpu0) == 0.0
        a = await cluster.start_instance(first, cpu0)
        second = cluster.plan("b", cpu0)
        # it waits for the whole of the first load: its weights and its initial KV cache
        assert second.load_wait_s == pytest.approx(first.expected_load_s) and first.expected_load_s > load
        assert second.expected_load_s == pytest.approx(2 * first.expected_load_s)
        assert cluster.plan("c", cpu1).load_wait_s == 0.0  # another node loads at once
        b = await cluster.start_instance(second, cpu0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        ready = {}
        while len(ready) < 2:
            await asyncio.sleep(0.001)
            for ref in (a, b):
                if ref.inst.loaded and ref.instance_id not in ready:
                    ready[ref.instance_id] = loop.time() - start
        assert cluster.load_wait_s(cpu0) == 0.0  # both done
        await cluster.stop()
        return ready[a.instance_id], ready[b.instance_id], first.expected_load_s

    a_ready, b_ready, one_load = run_virtual(main())
    assert a_ready == pytest.approx(one_load, abs=0.002)
    assert b_ready - a_ready == pytest.approx(one_load, abs=0.002)


def test_a_warm_up_goes_to_the_node_that_loads_it_first_and_waits_for_its_models_load():
    """Cold starts longer than the TTFT SLO (weights at 0.5 GB/s: 4 s): the first request of
    each model starts a warm-up. Model b's goes to the empty node rather than behind a's load
    (bin-packing alone would stack them), and a second request of a model still loading
    starts nothing more."""
    async def main():
        cluster, d = await build("mesh", {"a": "llama-2-7b", "b": "llama-2-7b"},
                                 config(cpu=2, gpu=0, cold_start=ColdStart(20 * GB, 0.5 * GB)))
        for rid, model in (("a1", "a"), ("b1", "b"), ("a2", "a")):
            d.submit(request(rid, model, prompt=100, out=3))
            await asyncio.sleep(0.1)
        hosts = {m: sorted(cluster.hosts(m)) for m in ("a", "b")}
        warm_ups = d.policy.stats.warm_ups
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return hosts, warm_ups

    hosts, warm_ups = run_virtual(main())
    assert warm_ups == 2 and len(hosts["a"]) == len(hosts["b"]) == 1 and hosts["a"] != hosts["b"]


def test_a_warm_up_skips_a_cpu_node_that_serves():
    """Issue 31 item 2: a warm-up that scales a model out is background work. Two CPU nodes,
    cold starts longer than the TTFT SLO, model b already running on one of them: with model
    a serving on the other, b's second instance is not warmed up there (its build would
    slow a's requests); with that node empty, it is. A model's first instance is warmed up
    even beside others (else it would never be served)."""
    async def main(with_a: bool):
        cluster, d = await build("mesh", {"a": "llama-2-7b", "b": "llama-2-7b"},  # one request per instance
                                 config(cpu=2, gpu=0, cold_start=ColdStart(20 * GB, 0.5 * GB), max_batch=1))
        d.submit(request("b1", "b", prompt=100, out=4000))  # b's first instance: a cold start, then a long decode
        await asyncio.sleep(0.05)
        if with_a:
            d.submit(request("a1", "a", prompt=100, out=4000))  # a's first instance, on the other node
        await asyncio.sleep(20.0)  # loaded and serving
        hosts = {m: sorted(cluster.hosts(m)) for m in ("a", "b")}
        before = d.policy.stats.warm_ups
        d.submit(request("b2", "b", prompt=100, out=3))  # b's instance is full (max_batch=1)
        await asyncio.sleep(0.1)
        after, warm_ups = sorted(cluster.hosts("b")), d.policy.stats.warm_ups - before
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return hosts, after, warm_ups

    hosts, after, warm_ups = run_virtual(main(with_a=True))
    assert hosts["a"] and hosts["b"] and hosts["a"] != hosts["b"]  # both first instances started: one per node
    assert warm_ups == 0 and after == hosts["b"]  # no second b beside a
    hosts, after, warm_ups = run_virtual(main(with_a=False))
    assert warm_ups == 1 and len(after) == 2  # the empty node warms b's second instance up


def test_arrivals_during_a_slow_decision_wait_in_the_bounded_queue():
    """Live, a decision can take seconds (a scale-out multicasts weights). Requests for the
    model that arrive meanwhile wait in the bounded queue, not on the model's decision
    lock: its capacity holds, the rest are turned away, and the queue shows them."""
    async def main():
        cluster, d = await build("sllm", {"m": "llama-2-7b"}, config(cpu=1, gpu=1), queue_capacity=5)
        place = d.policy.place

        async def slow(req, now, avoid):
            await asyncio.sleep(2.0)
            return await place(req, d.now(), avoid)

        d.policy.place = slow
        reqs = []
        for i in range(50):  # one every 10 ms: all but the first arrive while its decision runs
            reqs.append(request(f"r{i}", "m", out=3))
            d.submit(reqs[-1])
            await asyncio.sleep(0.01)
        during = len(d.queue), d.stats.rejected["queue full"]
        d.close()
        await d.all_done.wait()
        await cluster.stop()
        return during, reqs, d

    (waiting, full), reqs, d = run_virtual(main())
    assert (waiting, full) == (5, 44)  # one decision under way, five waiting, the rest turned away at once
    counts = d.accounting()
    assert counts["requests"] == 50 and counts["completed"] + counts["rejected"] + counts["failed"] == 50
    assert counts["completed"] == 6 and all(r.outcome is not None for r in reqs)  # the one decided, the five waiting
