"""The instances a node agent runs: load, ready or failed, unload; their iteration times and
O_avg; the folders `load` may open; the weights files a multicast writes here.

`load` builds the engine (off the event loop), starts the instance on the node runtime
(its memory issued at the reservation station, 6.3) and reports `instance` ready once the
node sized its KV cache (and, for OpenVINO, once its tokenizer is built) or failed.
Stopped OpenVINO and vLLM workers park (mesh.engines.parking); a received GGUF is
prepared in the background for the next loads (mesh.engines.background_prepare).
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

from mesh.engines.background_prepare import NEXT_LOAD_S, BackgroundPreparer
from mesh.engines.emulated import EmulatedEngine
from mesh.engines.emulation import ENGINE as EMULATED
from mesh.engines.emulation import Emulation, model_of_profile
from mesh.engines.engine_api import EngineError
from mesh.engines.openvino_process import OpenVINOProcessEngine
from mesh.engines.parking import ParkingLot
from mesh.node.control_connection import Refused
from mesh.node.engine_host import iteration_times, make_engine
from mesh.node.lending import PartnerLink
from mesh.node.live_counts import LiveCounts
from mesh.node.node_learning import NodeLearning
from mesh.node.park_ahead import ParkAhead
from mesh.node.runtime import NodeRuntime
from mesh.node.tokenizers import TokenizerProcess
from mesh.perf.model import PerformanceModel
from mesh.perf.times import AdaptiveTimes
from mesh.policy.kv_demand import RunningMean
from mesh.policy.node_spec import NodeSpec
from mesh.weights.blocks import Manifest, holds
from mesh.weights.receiver import NodeWeightsReceiver, inside, received_path
from mesh.wire.agent_protocol import (
    Ack,
    Code,
    Event,
    InstanceEvent,
    InstanceSpec,
    LoadReply,
    Unload,
    WeightsDrop,
    WeightsDropReply,
    WeightsPath,
    WeightsPathReply,
    slo_from_dict,
)
from mesh.wire.layers import Peer
from mesh.wire.served_request import Outcome

log = logging.getLogger(__name__)

MEAN_OUTPUT_PRIOR = 128  # O_avg before an instance has finished any request (LLM-Mesh 6.1)
EXPECTED_LOAD_S = 5.0  # what shadow validation assumes while an instance loads
EMULATED_NEVER_LEARNS = 2**62  # AdaptiveTimes.margin_after of an emulated instance: no learnt margin


class InstanceHost:
    """One node's model instances and what is kept per instance and per model."""

    def __init__(self, spec: NodeSpec, node: NodeRuntime, send: Callable[[Event], None], *,
                 emulation: Emulation | None, weights: NodeWeightsReceiver | None, load_roots: Sequence[str | Path],
                 learning: NodeLearning, parking: ParkingLot, preparer: BackgroundPreparer, ahead: ParkAhead,
                 tokenizers: TokenizerProcess) -> None:
        """`send`: queues an event for the control service. `load_roots`: folders whose files
        `load` may open, besides the weights receiver's."""
        self.spec = spec
        self.node = node
        self.send = send
        self.emulation = emulation
        self.weights = weights  # receives model blocks over the network (None: not hosted)
        self.live = LiveCounts()  # live scaling's, on this node (mesh.node.live_counts)
        self.load_roots = [Path(r) for r in load_roots] + ([Path(weights.root)] if weights is not None else [])
        self.learning = learning  # the machine's speed and per-model times
        self.parking = parking  # stopped OpenVINO instances, built and warm
        self.preparer = preparer  # GGUFs loaded here are prepared once, for the next loads
        self.ahead = ahead  # models described here are built once before their first request and parked
        self.tokenizers = tokenizers
        self.specs: dict[str, InstanceSpec] = {}
        self.times: dict[str, AdaptiveTimes] = {}  # instance id -> its iteration times
        self.means: dict[str, RunningMean] = {}  # O_avg per model (mean_output)
        self._tokenizers_ready: dict[str, asyncio.Future] = {}  # loading OpenVINO instance -> its tokenizer's build
        node.on_loaded = self._ready
        node.on_hung = self._hung

    # ---- load and unload ---------------------------------------------------------------
    async def load(self, spec: InstanceSpec) -> LoadReply:
        self.check_engine(spec.engine)
        if spec.engine != EMULATED:
            self.check_path(spec.path)
        if spec.instance_id in self.node.instances or spec.instance_id in self.specs:
            raise Refused(Code.BAD_REQUEST, f"instance {spec.instance_id} already exists on {self.spec.node_id}")
        slo = slo_from_dict(spec.slo)
        self.specs[spec.instance_id] = spec  # reserve the id while the engine is built
        try:
            try:
                engine = (self.emulated(spec) if spec.engine == EMULATED else
                          await asyncio.to_thread(make_engine, spec, lambda exc: self._loaded(spec.instance_id, exc)))
                if hasattr(engine, "parking"):  # OpenVINO and vLLM workers park when they stop (mesh.engines.parking)
                    engine.parking = self.parking
                if isinstance(engine, OpenVINOProcessEngine):  # its tokenizer is built while it loads
                    engine.parked_soon = self.ahead.pending(spec.model)  # or adopted from a build under way
                    tokenizer = asyncio.ensure_future(self.tokenizers.prepare(spec.path))
                    tokenizer.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure shows at tokenize
                    self._tokenizers_ready[spec.instance_id] = tokenizer
                times = self.learning.adopt(spec.model, self.times_for(spec, engine.weight_bytes))
            except EngineError as exc:
                raise Refused(Code.BAD_REQUEST, str(exc)) from exc
            issued = self.node.memory_ops.start_instance(spec.instance_id, spec.model, engine, times, slo,
                                              self.mean_output(spec.model, spec.mean_output),
                                              EXPECTED_LOAD_S if spec.expected_load_s is None else spec.expected_load_s)
            if not issued.accepted:
                raise Refused(Code.MEMORY, f"node {self.spec.node_id} memory budget is short by "
                              f"{issued.shortfall_bytes / 2**20:.0f} MiB to load {spec.model}",
                              shortfall_bytes=issued.shortfall_bytes)
        except BaseException:
            self.specs.pop(spec.instance_id, None)
            raise
        self.times[spec.instance_id] = times
        return LoadReply(engine.weight_bytes, engine.kv_bytes_per_token, engine.context_window)

    def _ready(self, instance_id: str) -> None:
        """The node runtime has the instance loaded (its engine loaded and its KV cache sized:
        it can be given requests now); an OpenVINO instance is reported ready once its
        tokenizer is built too. (The engine's own callback comes before the KV sizing: a
        `ready` sent then let the service's next call find the instance still loading.)"""
        tokenizer = self._tokenizers_ready.pop(instance_id, None)
        inst = self.node.instances.get(instance_id)
        source = str(getattr(inst.engine, "loaded_from", None) or "") if inst is not None else ""
        ready = InstanceEvent(instance_id, "ready", loaded_from=source)  # the service measures its load
        if tokenizer is None or tokenizer.done():
            self.send(ready)
        else:
            tokenizer.add_done_callback(lambda _f: self.send(ready))

    def received(self, path: str) -> None:
        """A model's file arrived here (its first host copy, or a multicast for a scale-out):
        prepare it now, in the background, so that the first load here already reads the
        node's prepared IR (a file that is not a GGUF, or is prepared, is left alone)."""
        try:
            self.preparer.schedule(path)
        except Exception as exc:  # noqa: BLE001 - preparation is an optimisation; the load reads the GGUF
            log.warning("cannot prepare received %s: %s", path, exc)

    def _loaded(self, instance_id: str, exc: BaseException | None) -> None:
        """The engine's load callback: a failure is reported here (success by `_ready`)."""
        if exc is None:
            spec = self.specs.get(instance_id)
            if spec is not None and spec.engine == "openvino":  # loaded: prepare its GGUF for the next loads,
                # which come no sooner than its instance stops (after models a first load still waits for)
                self.preparer.schedule(spec.path, asyncio.get_running_loop().time() + NEXT_LOAD_S)
            return
        self._tokenizers_ready.pop(instance_id, None)
        log.error("loading instance %s failed: %s", instance_id, exc)
        self.send(InstanceEvent(instance_id, "failed", error=f"{exc}"))
        asyncio.get_running_loop().call_soon(self._drop_instance, instance_id)

    def _hung(self, instance_id: str, why: str) -> None:
        """The node's watchdog failed a hung instance (its requests went back as evictions,
        sent before this): the service forgets it and places new ones where needed."""
        self.send(InstanceEvent(instance_id, "failed", error=why))
        self.specs.pop(instance_id, None)
        self.times.pop(instance_id, None)

    def _drop_instance(self, instance_id: str) -> None:
        inst = self.node.instances.get(instance_id)
        if inst is None:
            return
        for rid in list(inst.requests):
            self.node.abort(rid, Outcome.FAILED, f"instance {instance_id} failed to load")
        self.node.memory_ops.stop_instance(instance_id)
        self.specs.pop(instance_id, None)
        self.times.pop(instance_id, None)

    def unload(self, m: Unload) -> Ack:
        iid = m.instance_id
        inst = self.node.instances.get(iid)
        if inst is None:
            raise Refused(Code.NO_INSTANCE, f"no instance {iid} on {self.spec.node_id}")
        if inst.requests:
            raise Refused(Code.BUSY, f"instance {iid} still serves {len(inst.requests)} requests")
        self.node.memory_ops.stop_instance(iid)
        self.specs.pop(iid, None)
        self.times.pop(iid, None)
        return Ack()

    def instance(self, iid: str) -> Any:
        inst = self.node.instances.get(iid)
        if inst is None:
            raise Refused(Code.NO_INSTANCE, f"no instance {iid} on {self.spec.node_id}")
        return inst

    def ready_instance(self, iid: str) -> Any:
        inst = self.instance(iid)
        if not inst.loaded:
            raise Refused(Code.NOT_READY, f"instance {iid} is still loading")
        return inst

    # ---- what an instance is built and planned with ----------------------------------------
    def check_engine(self, engine: str) -> None:
        """An emulating node runs emulated models only, and only an emulating node runs them."""
        if engine == EMULATED and self.emulation is None:
            raise Refused(Code.BAD_REQUEST, f"node {self.spec.node_id} does not emulate: it runs no emulated models "
                          "(start its agent with --emulate DEVICE, or the service with mesh serve --emulate)")
        if engine != EMULATED and self.emulation is not None:
            raise Refused(Code.BAD_REQUEST, f"node {self.spec.node_id} emulates {self.emulation.device}: it runs "
                          f"emulated models only, not {engine} ones")

    def check_path(self, path: str) -> None:
        if not any(inside(root, path) for root in self.load_roots):
            roots = ", ".join(str(r) for r in self.load_roots) or "none"
            raise Refused(Code.BAD_REQUEST, f"{path} is outside this agent's model folders ({roots}); send the "
                          "model to the node (weights plane) or start the agent with --models-root DIR")

    def emulated(self, spec: InstanceSpec) -> EmulatedEngine:
        """An emulated instance of the catalog model `spec.path` on this node's device."""
        assert self.emulation is not None
        engine = self.emulation.engine(spec.instance_id, spec.path, spec.model, spec.context_window,
                                       spec.max_num_seqs, spec.emulated_load_s, spec.emulated_layers)
        partner = spec.emulated_partner
        if partner is not None and spec.emulated_layers:  # live: ZigZag with it (mesh.node.lending)
            try:
                token = partner.get("token")
                engine.ask_partner = PartnerLink(Peer(str(partner["address"]), None if token is None else str(token)),
                                                 str(partner["instance_id"]), self.live)
                engine.link_bytes_per_s = float(partner["link_bytes_per_s"])
            except (KeyError, TypeError, ValueError) as exc:
                raise Refused(Code.BAD_REQUEST, f"bad emulated_partner {partner!r}: {exc}") from exc
        return engine

    def times_for(self, spec: InstanceSpec, weight_bytes: int) -> AdaptiveTimes:
        """The instance's predicted iteration times: an emulated model's from its catalog
        profile on this device (the profile its engine keeps), else mesh.node.engine_host'."""
        name = model_of_profile(spec.profile)
        if name is None:
            if spec.profile:  # a calibration file: read only from the agent's own folders, as models are
                self.check_path(spec.profile)
            return iteration_times(spec, weight_bytes)
        if self.emulation is None:
            raise EngineError(f"node {self.spec.node_id} does not emulate: it has no times for {spec.profile}")
        # An emulated engine keeps its profile's times (mesh.engines.emulated.WallPace), noise aside:
        # nothing to learn (what it would learn is this host's lag), so its validation plans
        # with the profile and the node's margin, as the replay's does.
        return AdaptiveTimes(PerformanceModel(self.emulation.profile(name)), alpha=0.0, prefill_alpha=0.0,
                             margin_after=EMULATED_NEVER_LEARNS)

    def mean_output(self, model: str, state: tuple[float, int, float] | None, keep: bool = True) -> RunningMean:
        """O_avg of `model` on this node: one mean shared by its instances and plans (6.1),
        set to the control service's state where a message brings it (the service's counts
        every node's completions; this node's own are added here until the next one).
        `keep=False` (a plan validated, no instance here): a model new here is not kept (a
        deleted model's plan validated after its forget would keep its mean)."""
        mean = self.means.get(model)
        if mean is None:
            mean = RunningMean(MEAN_OUTPUT_PRIOR)
            if keep:
                self.means[model] = mean
        if state is not None:
            mean.prior, mean.count, mean.total = state
        return mean

    def learn_times(self) -> None:
        """What the node's iterations took, into each instance's times (at every flush)."""
        records = self.node.iterations
        for rec in records:
            times = self.times.get(rec.instance_id)
            if times is not None:
                times.observe(rec.kind, rec.predicted_s, rec.duration_s, rec.batch_size, rec.tokens,
                              rec.start_s + rec.duration_s)
        records.clear()
        now = asyncio.get_running_loop().time()
        for times in self.times.values():  # slowness no iteration confirmed lately fades (AdaptiveTimes.relax)
            times.relax(now)

    def view(self, inst: Any, now: float | None = None) -> dict[str, Any]:
        """An instance as `hello` and `stats` show it."""
        engine = inst.engine
        iid = inst.instance_id
        state = self.node.compute.instances.get(iid)
        kv_budget = self.node.memory.kv_bytes(iid) if iid in self.node.memory.instances else 0
        times = self.times.get(iid)
        return {
            "instance_id": iid, "model": inst.model, "loaded": inst.loaded, "batch_size": inst.batch_size,
            "pending": len(state.pending) if state else 0,
            "idle_for_s": (now - inst.idle_since) if (now is not None and not inst.requests) else 0.0,
            "weight_bytes": engine.weight_bytes, "kv_bytes_budget": kv_budget,
            "kv_bytes_in_use": engine.kv_bytes_in_use(),
            "kv_bytes_allocated": engine.kv_bytes_allocated() if hasattr(engine,
                                                                         "kv_bytes_allocated") and inst.loaded else 0,
            "context_window": engine.context_window,
            "time_factors": times.drift() if times else None,
        }

    # ---- the weights files a multicast writes here -------------------------------------------
    async def weights_path(self, m: WeightsPath) -> WeightsPathReply:
        """Where this node writes a received model file (the `output_path` of a multicast);
        with a `manifest`, also whether the file there already is that model (`complete`)."""
        if self.weights is None:
            raise Refused(Code.BAD_REQUEST,
                          f"node {self.spec.node_id} receives no weights (start it with --weights-listen)")
        try:
            path = received_path(self.weights.root, m.model, m.file)
            manifest = Manifest.from_dict(m.manifest) if m.manifest is not None else None
        except (KeyError, ValueError, TypeError) as exc:
            raise Refused(Code.BAD_REQUEST,
                          f"weights_path needs a model, a file name and a valid manifest: {exc}") from exc
        if manifest is None:
            return WeightsPathReply(str(path))
        return WeightsPathReply(str(path), await asyncio.to_thread(holds, path, manifest))  # sha256 releases the GIL

    def weights_drop(self, m: WeightsDrop) -> WeightsDropReply:
        """Delete a model's received files (the model was deleted); `dropped`: were there any."""
        if self.weights is None:
            raise Refused(Code.BAD_REQUEST,
                          f"node {self.spec.node_id} receives no weights (start it with --weights-listen)")
        try:
            folder = received_path(self.weights.root, m.model, "file").parent
        except (KeyError, ValueError) as exc:
            raise Refused(Code.BAD_REQUEST, f"weights_drop needs a model: {exc}") from exc
        existed = folder.is_dir()
        shutil.rmtree(folder, ignore_errors=True)
        return WeightsDropReply(existed)
