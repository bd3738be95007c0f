"""The replay's simulated cluster: one simulated node per node of a ClusterConfig.

The runtime (mesh.control.cluster_view) schedules whatever nodes it is given and builds none;
a replay gives it LocalNodes whose instances are mesh.engines.simulated.SimulatedEngines, with
iteration times from the catalog's profiles, the config's noise, and a seed per instance
derived from the config's seed and the instance's id (so a replay is the same for the
same seed). `engine_factory` replaces the simulated engine of every new instance (e.g.
mesh.replay.cold_start_modes.Engines, or a test's double).
"""
from __future__ import annotations

import zlib
from typing import Callable

from mesh.engines.engine_api import Engine
from mesh.engines.simulated import SimulatedEngine
from mesh.control.cluster_view import ClusterView, ClusterConfig, ModelSpec
from mesh.replay.local_node import LocalNode
from mesh.node.runtime import InstancePlan, NodeRuntime

# (plan, node kind, load seconds, seed) -> the engine of a new instance
EngineFactory = Callable[[InstancePlan, str, float, int], Engine]


class Simulator:
    """A ClusterView of simulated nodes (`cluster`) and the factory of their engines."""

    def __init__(self, config: ClusterConfig, catalog: dict[str, ModelSpec], models: dict[str, str],
                 mean_output_prior: dict[str, float], *, on_capacity: Callable[[], None] | None = None,
                 engine_factory: EngineFactory | None = None) -> None:
        self.config = config
        self.engine_factory: EngineFactory = engine_factory or self.simulated_engine
        nodes = [LocalNode(NodeRuntime(spec, margin=config.margin, watermark=config.watermark,
                                       deadlines=config.deadlines), self._engine_for)
                 for spec in config.node_specs()]
        self.cluster = ClusterView(config, catalog, models, mean_output_prior, on_capacity=on_capacity, nodes=nodes)

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
                      mean_output_prior: dict[str, float], **kwargs) -> ClusterView:
    """A ClusterView of simulated nodes (Simulator's)."""
    return Simulator(config, catalog, models, mean_output_prior, **kwargs).cluster
