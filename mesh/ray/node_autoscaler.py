"""Node autoscaling on Ray (`mesh serve --ray --ray-autoscale`).

Every `period_s` the autoscaler reads the cluster control's view, groups it by Ray node, and
applies mesh.policy.autoscale.decide:

- it asks Ray's autoscaler for `wanted` nodes' worth of agents with
  `ray.autoscaler.sdk.request_resources(bundles=[{"CPU": 1}] * wanted)` (a floor the
  autoscaler keeps, launching nodes when the cluster has fewer; each agent actor holds one
  CPU of its node);
- it releases the idle nodes the rule names: their agents leave the cluster and their
  actors end, so the node holds no Ray work and Ray's autoscaler removes it after its own
  idle timeout (`idle_timeout_minutes` of the cluster config);
- when Mesh wants more nodes than it has agents on, a released node that is still alive
  gets its agents back first.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from mesh.policy.autoscale import NodeUse, ScaleDecision, decide
from mesh.tasks import cancel_all

log = logging.getLogger(__name__)


class RayAutoscaler:
    def __init__(self, control: Any, membership: Any, period_s: float = 5.0, idle_release_s: float = 120.0,
                 min_nodes: int = 1) -> None:
        self.control, self.membership = control, membership
        self.period_s, self.idle_release_s, self.min_nodes = period_s, idle_release_s, min_nodes
        self.last: ScaleDecision | None = None
        self._idle_since: dict[str, float] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ray autoscaler")

    async def stop(self) -> None:
        await cancel_all([self._task])

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep scaling after a Ray hiccup
                log.exception("autoscaling step failed")
            await asyncio.sleep(self.period_s)

    def uses(self) -> tuple[list[NodeUse], int]:
        """Per Ray node Mesh has agents on: its instances, requests and idle time; and the
        requests waiting refused."""
        now = asyncio.get_running_loop().time()
        view = {n["node_id"]: n for n in self.control.view()["nodes"]}
        refused = self.control.waiting()
        out = []
        for ray_id, node in self.membership.nodes.items():
            if node.released:
                continue
            mine = [view[m] for m in node.agents if m in view]
            instances = sum(len(n["instances"]) for n in mine)
            requests = sum(int(n["running"]) + int(n["queue_length"]) for n in mine)
            if instances or requests:
                self._idle_since.pop(ray_id, None)
                idle = 0.0
            else:
                idle = now - self._idle_since.setdefault(ray_id, now)
            out.append(NodeUse(ray_id, instances, requests, idle))
        return out, refused

    async def step(self) -> ScaleDecision:
        from ray.autoscaler.sdk import request_resources

        uses, refused = self.uses()
        decision = decide(uses, refused, self.idle_release_s, self.min_nodes)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: request_resources(bundles=[{"CPU": 1}] * decision.wanted))
        for ray_id in decision.release:
            log.warning("releasing idle Ray node %s (autoscaling)", ray_id[:12])
            await self.membership.release(ray_id, "released by the autoscaler: idle")
            self._idle_since.pop(ray_id, None)
        if decision.wanted > len(uses):
            for ray_id, node in list(self.membership.nodes.items()):
                if node.released and ray_id in self.membership.alive:
                    await self.membership.rejoin(ray_id)
                    break
        self.last = decision
        return decision
