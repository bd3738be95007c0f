"""ZigZag between emulated node agents: a partner lends its node's time to a live instance.

When the service scales a model out by multicast with live scaling (mesh.control.load_timing),
the new (target) instance serves from its first layer on, and its partner, a full instance of
the model on another node, pulls the rest of an iteration whenever it has no request of its own
waiting for prefill (BlitzScale 5.2, Fig. 16), as the twin's WeightsEngine does in a replay.
On emulated nodes (mesh.engines.emulated) nothing is computed, so what crosses is the decision
and its time: the target's engine asks (`PartnerLink`, a `lend` on the partner agent's layer
port, mesh.wire.layers) and the partner's agent answers (`Lender`) by the same rules
(mesh.policy.live_scaling: `source_pull`, `lend_helps`, `pulled_finish`), reserving its node's
time for the layers it runs (WallPace.reserve), so its own next iteration waits for them.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

from mesh.engines.emulated import EmulatedEngine
from mesh.framing import ProtocolError
from mesh.node.live_counts import LiveCounts
from mesh.policy.live_scaling import ZigZagRequest, ZigZagState, lend_helps, pulled_finish, source_pull
from mesh.wire.layers import LayerCallFailed, LayerConnection, Lend, Lent, Peer

log = logging.getLogger(__name__)


class Lender:
    """The source side: answers a target's `lend` for one of this node's emulated instances."""

    def __init__(self, instances: Mapping[str, Any], counts: LiveCounts) -> None:
        self.instances = instances  # the node runtime's: instance id -> NodeInstance
        self.counts = counts

    def lend(self, m: Lend) -> Lent:
        inst = self.instances.get(m.model)
        engine = inst.engine if inst is not None and inst.loaded else None
        if not isinstance(engine, EmulatedEngine) or engine.pace is None:
            return Lent(False, why=f"instance {m.model} is not a loaded emulated instance here")
        if not m.from_layer < m.layers:
            return Lent(False, why="no layer left to run")
        now = asyncio.get_running_loop().time()
        state = ZigZagState(m.layers, m.layers, (ZigZagRequest("iteration", 0, m.from_layer),),
                            source_idle=engine.zigzag_idle())
        pull = source_pull(state)
        if pull is None:
            return Lent(False, why="its own requests wait for prefill")
        free = engine.pace.free_at(now)
        if not lend_helps(now, m.work_s, pull.from_layer, m.layers, free, m.transfer_s, now + m.alone_s):
            return Lent(False, why="the target alone would end sooner")
        end = pulled_finish(now, m.work_s, pull.from_layer, m.layers, free, m.transfer_s)
        engine.pace.reserve(end)
        self.counts.lent += 1
        return Lent(True, end - now)


class PartnerLink:
    """The target side: a live emulated engine's `ask_partner`, over the partner agent's layer
    port. A partner that cannot be reached (or fails a call) is asked no more: the instance
    then serves alone with its layers, as shadow validation predicts."""

    def __init__(self, peer: Peer, partner_instance: str, counts: LiveCounts) -> None:
        self.peer = peer
        self.partner_instance = partner_instance
        self.counts = counts
        self._conn: LayerConnection | None = None
        self._gone = False

    async def __call__(self, from_layer: int, layers: int, work_s: float, transfer_s: float,
                       alone_s: float) -> float | None:
        if self._gone:
            return None
        try:
            if self._conn is None:
                self._conn = await LayerConnection.open(self.peer, timeout_s=2.0)
            reply, _ = await self._conn.call(Lend(self.partner_instance, from_layer, layers, work_s, transfer_s,
                                                  alone_s).to_header(0))
        except (OSError, ConnectionError, ProtocolError, LayerCallFailed, asyncio.TimeoutError) as exc:
            log.warning("partner %s at %s: %s; the live instance serves alone", self.partner_instance,
                        self.peer.address, exc)
            self._gone = True
            return None
        lent = Lent.from_fields(reply)
        if not lent.lent:
            return None
        self.counts.pulls += 1
        return lent.after_s

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
