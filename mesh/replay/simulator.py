"""The replay's simulated cluster: one simulated node per node of a ClusterConfig.

The runtime (mesh.runtime.cluster) schedules whatever nodes it is given and builds none;
a replay gives it LocalNodes whose instances are engines.simulated.SimulatedEngines, with
iteration times from the catalog's profiles, the config's noise, and a seed per instance
derived from the config's seed and the instance's id (so a replay is the same for the
same seed). `engine_factory` replaces the simulated engine of every new instance (e.g.
mesh.weights.cold_start.Engines, or a test's double).
"""
from __future__ import annotations

import zlib
from typing import Callable

from engines.protocol import Engine
from engines.simulated import SimulatedEngine
from mesh.runtime.cluster import Cluster, ClusterConfig, ModelSpec
from mesh.runtime.cluster_node import LocalNode
from mesh.runtime.node import InstancePlan, NodeRuntime

# (plan, node kind, load seconds, seed) -> the engine of a new instance
EngineFactory = Callable[[InstancePlan, str, float, int], Engine]


class Simulator:
    """A Cluster of simulated nodes (`cluster`) and the factory of their engines."""

    def __init__(self, config: ClusterConfig, catalog: dict[str, ModelSpec], models: dict[str, str],
                 mean_output_prior: dict[str, float], *, on_capacity: Callable[[], None] | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.engine_factory: EngineFactory = engine_factory or self.simulated_engine
        nodes = [LocalNode(NodeRuntime(spec, margin=config.margin, watermark=config.watermark,
                                       deadlines=config.deadlines), self._engine_for)
                 for spec in config.node_specs()]
        self.cluster = Cluster(config, catalog, models, mean_output_prior, on_capacity=on_capacity, nodes=nodes)

    def _engine_for(self, plan: InstancePlan, kind: str) -> Engine:
        """The engine of a new instance on a simulated node (the run's engine factory)."""
        load_s = self.cluster.simulated_load_s(plan, kind)
        seed = zlib.crc32(f"{self.config.seed}:{plan.instance_id}".encode())
        return self.engine_factory(plan, kind, load_s, seed)

    def simulated_engine(self, plan: InstancePlan, kind: str, load_s: float, seed: int) -> Engine:
        return SimulatedEngine(
            plan.model, plan.times, kv_bytes_per_token=plan.kv_bytes_per_token, weight_bytes=plan.weight_bytes,
            context_window=plan.context_window, prefill_token_budget=plan.prefill_token_budget,
            max_batch=plan.max_batch, load_s=load_s, noise=self.config.noise, seed=seed,
        )


def simulated_cluster(config: ClusterConfig, catalog: dict[str, ModelSpec], models: dict[str, str],
                      mean_output_prior: dict[str, float], **kwargs) -> Cluster:
    """A Cluster of simulated nodes (Simulator's)."""
    return Simulator(config, catalog, models, mean_output_prior, **kwargs).cluster
