"""Cold starts by where the weights come from, for replays.

Four modes (`WeightsConfig.mode`), all for GPU instances of one model:

- `ssd`: every cold start reads the weights from the node's local SSD:
  `fixed + bytes / ssd_bw` (default 3 GB/s, one NVMe drive).
- `host`: ServerlessLLM-style host cache: a node's first load of a model reads the SSD and
  keeps a copy in its host memory; later loads on that node copy host -> GPU over PCIe
  (`bytes / pcie_bw`, default 25 GB/s). Host memory is assumed large enough (no eviction).
- `multicast`: BlitzScale 5.1/5.3 and lambdaScale 4.2. The parameter pool
  (mesh.policy.param_pool) holds one host copy per model, placed at registration. A node
  with a host copy loads over PCIe; the others get the weights by network multicast. All
  instances of a model whose loads start at the same instant form one multicast; its
  sources are the pool's host copies and the nodes with a fully loaded instance of the
  model; the plan (`binomial` or `chain`, mesh.policy.multicast) is timed by
  `schedule()` (mesh.perf.load_times) under `CostModel(block_bytes, net_bw, latency)`, GPUDirect (the blocks land in
  GPU memory, no PCIe hop); a target's load time is its completion time. A node's uplink
  carries one multicast at a time: a multicast uses the sources whose uplink is free, else
  waits for the one that frees first (overlapping multicasts queue rather than share).
- `multicast-live`: `multicast` plus live scaling, by the rules of mesh.policy.live_scaling
  (the ones a live runtime uses). Block arrivals come from the multicast's schedule; a
  receiver's usable layers are its longest prefix of blocks (layers of equal bytes, the
  model's shape from mesh/modelfiles/shapes, else `WeightsConfig.layers`/`hidden_size`).
  * ZigZag (BlitzScale 5.2, Fig. 16): a new instance whose multicast starts while a fully
    loaded instance of the model (its partner) is not already partnered serves from its first
    layer on. Each of its iterations (full-speed time W) runs layer by layer on it as the
    layers arrive (`target_next`: W/L a layer); whenever the partner has no request waiting
    for prefill of its own (`source_pull`), it pulls the iteration with its activation
    (hidden x tokens x 2 bytes at the network bandwidth) and runs the remaining layers in
    (1 - f) W once its own iteration in flight ends, if that ends no later than the new
    instance alone would (`pull_helps`); the partner's next iteration then waits for it.
    From the last layer on, full speed; requests that had iterations pulled recompute their
    KV cache (prompt + tokens so far, as prefills) at the new instance's next iteration.
  * Execution pipelines (lambdaScale 4.3, Algorithm 2) for the receivers without a partner
    (a scale from zero): the multicast's sub-groups (binomial: `sub_groups`, one per source;
    chain: one per chain) form pipelines; from the first instant the members' held blocks
    cover the model (`stage_ranges`), each member serves, every iteration taking
    `pipeline_iteration_s` (W plus one activation hop per stage boundary, or the slowest
    stage times the batches in flight: the members with work), or the member alone if sooner. When every
    member holds the model, the mode switch (4.4): the pipeline's running requests are
    spread with `switch_assignment` and each member recomputes the KV cache of its share
    (prefills of prompt + tokens so far) before its next iteration.
  * Shadow validation predicts a live instance's iterations from its layers (the instance
    alone, mesh.policy.shadow.live_iteration_end): the engine gives its `layer_arrivals`.

What this does not model (docs/multicast.md, "Weights by network"): contention on the
receivers' downlinks or with serving traffic, including the activations' (their bytes are
counted, their time is a hop at full bandwidth); bandwidth sharing (overlapping multicasts
queue on a source's uplink instead); the runtime runs one iteration of an instance at a
time, so ZigZag's queue holds one batch (the live instance's current iteration) and two
batches never overlap across the pair (Fig. 15b's overlap of one request's layers with
another's on the partner); the KV cache the partner keeps for pulled layers (the twin
recomputes it at the end instead); a pipeline member's work for the other members' batches
is not charged to its node (balanced stages make the 2D pipeline's per-node work that of a
full instance, `pipeline_iteration_s` bounds the rest); the switch keeps requests on the
instance that admitted them (the runtime cannot move them), only the recompute cost follows
`switch_assignment`; shadow validation does not predict the partner's lent time or the
switch's recomputation.

Pure functions (mesh.control.load_timing.stop_the_world_s, mesh.policy.live_scaling's rules) have no clock;
the engines read time only from the event loop.
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mesh.control.load_timing import LiveRole, LoadTiming, WeightsConfig
from mesh.engines.engine_api import Engine, StepResult
from mesh.engines.simulated import SimulatedEngine
from mesh.policy.admission import InstancePlan
from mesh.policy.live_scaling import (
    LayerArrivals,
    ZigZagRequest,
    ZigZagState,
    activation_bytes,
    activation_s,
    pipeline_iteration_s,
    pull_helps,
    pulled_finish,
    recompute_s,
    recompute_tokens,
    solo_finish,
    source_pull,
    switch_assignment,
    target_next,
)

if TYPE_CHECKING:
    from typing import Callable

    from mesh.control.fleet import Fleet

    EngineFactory = Callable[[InstancePlan, str, float, int], Engine]  # mesh.replay.simulator.EngineFactory

_EPS = 1e-9


# --- the replay side -----------------------------------------------------------------------


class WeightsEngine(SimulatedEngine):
    """A simulated engine whose load time (and, live, early iterations) the weights model
    decides when the load starts. Every engine of a run is one, so that a partner can lend
    its time to a live instance's iterations (`lent_until`)."""

    def __init__(self, model_weights: "WeightsModel", plan: InstancePlan, node_id: str, **kwargs) -> None:
        super().__init__(plan.model, plan.times, **kwargs)
        self._weights = model_weights
        self._plan = plan
        self._node_id = node_id
        self.role: LiveRole | None = None
        self.busy_until = -math.inf  # the end of its iteration in flight
        self.lent_until = -math.inf  # the end of the live instance's layers it runs (ZigZag)
        self.changed = asyncio.Event()  # set after each iteration (a partner may turn idle)
        self._tokens = 0  # tokens of the iteration about to run (its activation's rows)
        self._batch: list[str] = []
        self._pulled: set[str] = set()  # requests whose layers the partner ran (KV there)
        self._switched = False

    @property
    def layer_arrivals(self) -> LayerArrivals | None:
        """For shadow validation (mesh.node.memory_operations): a live instance's layers."""
        return self.role.arrivals if self.role is not None else None

    async def load(self) -> None:
        await asyncio.sleep(0)  # instances placed in the same instant join one multicast
        ready_at, role = self._weights.engine_loading(self._plan, self._node_id, self)
        self.role = role
        delay = ready_at - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def unload(self) -> None:
        await super().unload()
        self._weights.engines.pop(self._plan.instance_id, None)

    # -- ZigZag's source side ------------------------------------------------------------
    def zigzag_idle(self) -> bool:
        """No request of its own waits for prefill (BlitzScale Fig. 16, line 5)."""
        return not self._pending

    def free_at(self, now: float) -> float:
        return max(now, self.busy_until, self.lent_until)

    # -- iterations ------------------------------------------------------------------------
    async def step(self) -> StepResult:
        loop = asyncio.get_running_loop()
        if self.lent_until > loop.time():  # running a live instance's layers first
            await asyncio.sleep(self.lent_until - loop.time())
        if self.role is not None and loop.time() >= self.role.until_s:
            await self._switch()
        try:
            return await super().step()
        finally:
            self.changed.set()
            self.changed = asyncio.Event()

    async def _prefill(self, take: int, switched: bool) -> StepResult:
        self._batch = list(self._pending)[:take]
        self._tokens = sum(self._pending[r][0] for r in self._batch)
        return await super()._prefill(take, switched)

    async def _decode(self, switched: bool) -> StepResult:
        self._batch = list(self._running)
        self._tokens = len(self._batch)
        return await super()._decode(switched)

    async def _pause(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        role = self.role
        if role is None or start >= role.until_s or start >= role.arrivals.full_s and role.pipeline is None:
            self.busy_until = start + seconds
            await asyncio.sleep(seconds)
            return
        hop = activation_s(role.hidden_size, max(1, self._tokens), role.link_bytes_per_s)
        if role.pipeline is not None:
            await self._pipelined(start, seconds, hop)
        else:
            await self._zigzag(start, seconds, hop)
        if loop.time() > start + seconds + hop + _EPS:  # it waited for layers
            self._weights.stats.waited.update(self._batch)

    async def _zigzag(self, start: float, work: float, hop: float) -> None:
        """One iteration as the target of ZigZag (module docstring)."""
        loop = asyncio.get_running_loop()
        role = self.role
        arr, layers = role.arrivals, role.arrivals.layers
        done, t = 0, start
        while done < layers:
            partner = self._weights.engines.get(role.partner or "")
            state = ZigZagState(layers, arr.held_at(t), (ZigZagRequest("iteration", 0, done),),
                                None, partner is not None and partner.zigzag_idle())
            pull = source_pull(state)
            if pull is not None and pull_helps(t, work, done, arr, partner.free_at(t), hop):
                end = pulled_finish(t, work, done, layers, partner.free_at(t), hop)
                partner.lent_until = max(partner.lent_until, end)
                stats = self._weights.stats
                stats.pulls += 1
                if done:
                    stats.activation_bytes += activation_bytes(role.hidden_size, max(1, self._tokens))
                self._pulled.update(self._batch)
                self.busy_until = end
                await asyncio.sleep(end - t)
                return
            if target_next(state) is not None:
                self.busy_until = t + work / layers
                await asyncio.sleep(work / layers)
                done += 1
            else:
                wait = arr.layer_at(done) - t
                if partner is None:
                    await asyncio.sleep(wait)
                else:
                    try:
                        await asyncio.wait_for(partner.changed.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
            t = loop.time()

    async def _pipelined(self, start: float, work: float, hop: float) -> None:
        """One iteration as a member of an execution pipeline (module docstring)."""
        role = self.role
        pipe = role.pipeline
        alone = solo_finish(start, work, role.arrivals)
        stages = pipe.stages(start)
        end = alone
        if stages is not None:
            engines = self._weights.engines
            batches = sum(1 for m in pipe.members if m in engines and engines[m].has_work())  # in flight
            through = start + pipeline_iteration_s(work, stages, hop, max(1, batches))
            if through < alone:
                end = through
                self._weights.stats.activation_bytes += (len(stages) - 1) * activation_bytes(
                    role.hidden_size, max(1, self._tokens))
        self.busy_until = end
        await asyncio.sleep(end - start)

    def _recompute_share(self) -> list[str]:
        """The requests whose KV cache this instance recomputes at the switch (4.4)."""
        pipe = self.role.pipeline
        if pipe is None:
            return [r for r in self._running if r in self._pulled]
        if pipe.assignment is None:
            engines = self._weights.engines
            reqs = [(rid, m) for m in pipe.members if m in engines for rid in engines[m]._running]
            live = [m for m in pipe.members if m in engines]
            pipe.assignment = switch_assignment(reqs, live) if live else {}
            self._weights.stats.switch_moves += sum(
                1 for m, rids in pipe.assignment.items() for rid in rids if rid not in engines[m]._running)
        return pipe.assignment.get(self._plan.instance_id, [])

    async def _switch(self) -> None:
        """Full instance from now: recompute the KV cache of its share (lambdaScale 4.4)."""
        share = self._recompute_share()
        engines = self._weights.engines
        tokens = []
        for rid in share:
            for eng in engines.values():
                entry = eng._running.get(rid)
                if entry is not None:
                    tokens.append(recompute_tokens(entry[0], eng._rounds - entry[2] + 1))
                    break
        self.role = None
        if tokens:
            self._weights.stats.recompute_tokens += sum(tokens)
            wait = recompute_s(self.times.prefill_s, tokens, self.prefill_token_budget)
            self.busy_until = asyncio.get_running_loop().time() + wait
            await asyncio.sleep(wait)


class WeightsModel(LoadTiming):
    """A replay's LoadTiming, with the engines it times (a partner lends its time to a live
    instance's iterations, a pipeline's members see each other's work); one per run."""

    def __init__(self, config: WeightsConfig, cluster: "Fleet") -> None:
        super().__init__(config, cluster)
        self.engines: dict[str, WeightsEngine] = {}  # instance id -> its engine, while loaded

    def factory(self) -> "EngineFactory":
        def make(plan: InstancePlan, kind: str, load_s: float, seed: int) -> Engine:
            node_id = plan.instance_id.rsplit("@", 1)[1].rsplit("#", 1)[0]
            self._join(plan, node_id)
            c = self.cluster.config
            engine = WeightsEngine(self, plan, node_id, kv_bytes_per_token=plan.kv_bytes_per_token,
                                   weight_bytes=plan.weight_bytes, context_window=plan.context_window,
                                   prefill_token_budget=plan.prefill_token_budget, max_batch=plan.max_batch,
                                   load_s=0.0, noise=c.noise, seed=seed)
            self.engines[plan.instance_id] = engine
            return engine
        return make

    def engine_loading(self, plan: InstancePlan, node_id: str, engine: "WeightsEngine"
                       ) -> tuple[float, LiveRole | None]:
        """`loading` for `engine`'s instance, which the others see from now on."""
        self.engines[plan.instance_id] = engine
        return self.loading(plan, node_id)



@dataclass
class Engines:
    """For ReplayConfig.engines: called with each run's cluster, builds that run's
    WeightsModel (kept in `models`, for its statistics) and returns its engine factory."""

    config: WeightsConfig
    models: list[WeightsModel] = field(default_factory=list)

    def __call__(self, cluster: "Fleet") -> "EngineFactory":
        model = WeightsModel(self.config, cluster)
        self.models.append(model)
        return model.factory()
