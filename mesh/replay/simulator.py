"""The replay's simulated cluster: one simulated node per node of a ClusterConfig.

The runtime (mesh.control.fleet) schedules whatever nodes it is given and builds none;
a replay gives it LocalNodes whose instances are mesh.engines.simulated.SimulatedEngines, with
iteration times from the catalog's profiles, the config's noise, and a seed per instance
derived from the config's seed and the instance's id (so a replay is the same for the
same seed). `engine_factory` replaces the simulated engine of every new instance (e.g.
mesh.replay.cold_start_modes.Engines, or a test's double).
"""
from __future__ import annotations

import zlib
from typing import Callable

from mesh.control.fleet import ClusterConfig, Fleet, ModelSpec
from mesh.engines.engine_api import Engine
from mesh.engines.parking import ParkingLot
from mesh.engines.simulated import SimulatedEngine
from mesh.node.runtime import NodeRuntime
from mesh.policy.admission import InstancePlan
from mesh.policy.dispatch_rules import CPU
from mesh.policy.param_pool import ParameterPool
from mesh.replay.local_node import LocalNode

# (plan, node kind, load seconds, seed) -> the engine of a new instance
EngineFactory = Callable[[InstancePlan, str, float, int], Engine]


class Simulator:
    """A Fleet of simulated nodes (`cluster`) and the factory of their engines."""

    def __init__(self, config: ClusterConfig, catalog: dict[str, ModelSpec], models: dict[str, str],
                 mean_output_prior: dict[str, float], *, on_capacity: Callable[[], None] | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.engine_factory: EngineFactory = engine_factory or self.simulated_engine
        self.cluster = Fleet(config, catalog, models, mean_output_prior, on_capacity=on_capacity)
        nodes = [LocalNode(NodeRuntime(spec, margin=config.margin, watermark=config.watermark,
                                       deadlines=config.deadlines), self._engine_for,
                           ParkingLot(config.park_bytes) if config.park_bytes and spec.kind == CPU else None,
                           listener=self.cluster)
                 for spec in config.node_specs()]
        for node in nodes:
            self.cluster.add_node(node)
        if config.park_bytes or config.host_copies:
            self._register(nodes, catalog, models)
        if config.host_copies:
            self.cluster.holds_copy = lambda model, node: node.kind != CPU or model in node.copies

    def _register(self, nodes: list[LocalNode], catalog: dict[str, ModelSpec], models: dict[str, str]) -> None:
        """Every model registered at the start, in name order as a live replay registers them:
        its first host copy on the CPU node the parameter pool chooses (BlitzScale 5.3), which
        holds it and, where it parks, builds it ahead in the time of a load and parks it
        (mesh.replay.local_node)."""
        cpus = {n.node_id: n for n in nodes if n.kind == CPU}
        pool = ParameterPool()
        for node in cpus.values():
            pool.add_node(node.node_id, node.spec.memory_bytes)
        cold = self.config.cold_start
        for model in sorted(models):
            spec = catalog[models[model]]
            if CPU not in spec.profiles or not cpus:
                continue
            weights = spec.profiles[CPU].weight_bytes
            nbytes = spec.min_bytes(CPU, self.config.watermark)
            node = cpus[pool.register(model, weights, among=cpus)]
            node.copies.add(model)
            node.build_ahead(model, cold.instance_load_s(weights, CPU, models[model], nbytes - weights), nbytes)

    def _engine_for(self, plan: InstancePlan, kind: str, adopted_s: float | None = None) -> Engine:
        """The engine of a new instance on a simulated node (the run's engine factory);
        `adopted_s`: it adopts a parked worker (LocalNode)."""
        load_s = self.cluster.simulated_load_s(plan, kind, adopted_s)
        seed = zlib.crc32(f"{self.config.seed}:{plan.instance_id}".encode())
        return self.engine_factory(plan, kind, load_s, seed)

    def simulated_engine(self, plan: InstancePlan, kind: str, load_s: float, seed: int) -> Engine:
        return SimulatedEngine(
            plan.model, plan.times, kv_bytes_per_token=plan.kv_bytes_per_token, weight_bytes=plan.weight_bytes,
            context_window=plan.context_window, prefill_token_budget=plan.prefill_token_budget,
            max_batch=plan.max_batch, load_s=load_s, noise=self.config.noise, seed=seed,
        )


def simulated_cluster(config: ClusterConfig, catalog: dict[str, ModelSpec], models: dict[str, str],
                      mean_output_prior: dict[str, float], **kwargs) -> Fleet:
    """A Fleet of simulated nodes (Simulator's)."""
    return Simulator(config, catalog, models, mean_output_prior, **kwargs).cluster
