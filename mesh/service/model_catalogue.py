"""The service's model catalogue: each registered model as the cluster knows it.

`ModelCatalogue` describes each model once, on a node agent that can run it (its shape, KV
bytes per token and tokenizer, without loading it), and adds it to the cluster with its
calibration profile (`--profile-dir`, <dir>/<model uid>.json) or the prior profile, its
cold-start and admission choices (mesh.policy.dispatch_rules). A model registered once runs on
every kind of node it has a format for (mesh.service.preparation: the registered one, and
one the service prepared for the other kind, such as a GGUF converted to a Hugging Face
folder for vLLM). It is described on an agent of each such kind whose nodes are up, so the
dispatcher gets a profile per kind and chooses the kind (CPU first under `mesh`, GPU only
under `sllm`); each instance loads its node kind's format (`load_spec`), its weights from the
node's own copy, which the weights plane multicasts there first if needed
(mesh.control.weights_plane). A deleted model leaves the cluster, the dispatcher and the
agents once its requests have ended (`forget_model`).

It reads the registry's records and answers a tenant's request with the clear 400 or 503
of mesh.service.errors when a model cannot run (`check_servable`), so it lives in the service;
the nodes ask it through mesh.control.node_pool.NodeModels.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from mesh.control.agent_client import AgentCallError, AgentDown
from mesh.control.agent_node import AgentNode, StartRefused
from mesh.control.dispatcher import Dispatcher
from mesh.control.emulated_loads import EmulatedLoads
from mesh.control.fleet import Fleet, ModelSpec
from mesh.control.weights_plane import ModelFormat, WeightsError, WeightsPlane
from mesh.engines.emulation import PROFILE_PREFIX
from mesh.modelfiles.formats import EMULATED, ENGINE_OF_KIND, FORMAT_NAMES, engine_for
from mesh.perf.times import prior_profile
from mesh.policy.admission import InstancePlan
from mesh.policy.dispatch_rules import CPU, kind_rank
from mesh.service.errors import ApiError, bad_request, model_preparing, node_unavailable
from mesh.service.preparation import FormatPreparer, formats_view
from mesh.service.registry import ModelRecord
from mesh.tasks import cancel_all
from mesh.wire.agent_protocol import Describe, DescribeReply, InstanceSpec, slo_to_dict

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
MEAN_OUTPUT_PRIOR = 128.0  # O_avg's starting value for a new model (6.1), tokens


@dataclass
class DescribedModel:
    """A registered model as the cluster knows it."""

    record: ModelRecord
    front: str  # the node whose agent tokenizes its prompts
    path: str  # its weights as that node sees them
    kinds: tuple[str, ...] = ()  # the kinds of node it was described on (its ModelSpec's profiles)
    vocab_size: int | None = None  # the smallest vocabulary its described formats report (None: unknown)


class ModelCatalogue:
    def __init__(self, cluster: Fleet, dispatcher: Dispatcher, emulated_kinds: frozenset[str],
                 formats: FormatPreparer | None, *, profile_dir: str | None = None, exact_moves: bool = False) -> None:
        """`emulated_kinds`: the kinds of node whose nodes all emulate, beside real ones (the
        mixed rig, `mesh serve --cpu-nodes N --emulate DEVICE:M`): they run real models
        emulated from their shape (mesh.engines.emulation). `formats` prepares each model's
        format for the other kind of node (None: a model runs on its registered format's
        kind only)."""
        self.cluster = cluster
        self.dispatcher = dispatcher
        self.emulated_kinds = emulated_kinds
        self.formats = formats
        self.profile_dir = profile_dir  # calibration profiles: <dir>/<model uid>[.<kind>].json
        self.exact_moves = exact_moves  # InstanceSpec.exact_moves for every instance
        self.weights: WeightsPlane | None = None  # once made (None: nodes load models from the registry's path)
        self.emulated_loads = EmulatedLoads(cluster)  # how long an emulated load takes, and how it serves
        self.models: dict[str, DescribedModel] = {}
        self._describing: dict[str, asyncio.Future] = {}
        # requests of each model between their arrival and the dispatcher (described, tokenized
        # on an agent): a deleted model's state leaves the agents only once none is left
        self._arriving: Counter[str] = Counter()
        self._registering: dict[str, asyncio.Task] = {}  # model -> its registration's copy and description
        self._shapes: dict[str, str] = {}  # model uid -> its emulated name on those kinds
        self._origins: dict[str, str] = {}  # instance -> where its weights came from
        self._profile_kinds: dict[tuple[str, int], str | None] = {}  # (profile file, mtime) -> its device kind
        self._tasks: set[asyncio.Task] = set()

    async def stop(self) -> None:
        await cancel_all(list(self._tasks))

    def _nodes(self) -> list[AgentNode]:
        return list(self.cluster.nodes)  # type: ignore[arg-type] - the service's nodes are AgentNodes

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- what the nodes ask (mesh.control.node_pool.NodeModels) ----------------------------
    def label(self, model_uid: str) -> ModelRecord | None:
        model = self.models.get(model_uid)
        return model.record if model is not None else None

    def origin(self, instance_id: str) -> str:
        return self._origins.get(instance_id, "registry path")

    def instance_stopped(self, instance_id: str) -> None:
        self._origins.pop(instance_id, None)

    def view(self) -> dict[str, dict[str, str]]:
        """The models the cluster knows (a deleted one leaves once its requests have ended)."""
        return {uid: {"tenant": m.record.tenant, "name": m.record.name} for uid, m in self.models.items()}

    # ---- models --------------------------------------------------------------------------------
    async def described(self, record: ModelRecord) -> DescribedModel:
        """The model in the cluster, described on first use (once, however many ask), and
        again when it changed (a format became ready) or a kind of node it can run on came up."""
        known = self.models.get(record.uid)
        if (known is not None and known.record == record and self.front_up(known)
                and set(self._kinds_up(record)) <= set(known.kinds)):
            return known
        pending = self._describing.get(record.uid)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._describing[record.uid] = pending
            try:
                pending.set_result(await self._describe(record))
            except BaseException as exc:
                pending.set_exception(exc)
                pending.exception()  # retrieved: a caller gets it below
            finally:
                self._describing.pop(record.uid, None)
        return await asyncio.shield(pending)

    @contextmanager
    def arriving(self, model_uid: str) -> Iterator[None]:
        """A request of the model on its way to the dispatcher (its description and tokenizing
        may touch an agent's state of the model): a deletion meanwhile waits for it."""
        self._arriving[model_uid] += 1
        try:
            yield
        finally:
            self._arriving[model_uid] -= 1
            if not self._arriving[model_uid]:
                del self._arriving[model_uid]

    def front_up(self, model: DescribedModel) -> bool:
        """Is the agent that tokenizes the model's prompts there and up? A model whose front
        left or went down is described again on another node; until then it keeps its record,
        so that its requests in flight (a lost node's, placed again) still load it."""
        return model.front in self.cluster.node_seq and self.cluster.node(model.front).up

    def _kinds_up(self, record: ModelRecord) -> list[str]:
        """The kinds of node that can run the model now: it has a format ready for them and
        one of their agents is up; CPU first."""
        up = {n.kind for n in self._nodes() if n.up}
        return [k for k in self.runnable_kinds(record) if k in up]

    def runnable_kinds(self, record: ModelRecord) -> tuple[str, ...]:
        """The kinds of node that can run the model once up: its formats' (ModelRecord.node_kinds)
        and, in the mixed rig, the emulated kinds, which emulate a real model from its shape."""
        if not self.emulated_kinds:
            return record.node_kinds
        if record.kind == EMULATED:  # a catalog model runs on the emulated nodes only
            return tuple(k for k in record.node_kinds if k in self.emulated_kinds)
        return tuple(sorted({*record.node_kinds, *self.emulated_kinds}, key=kind_rank))

    def _emulates(self, record: ModelRecord, kind: str) -> bool:
        """Do nodes of `kind` run this real model emulated (the mixed rig)?"""
        return record.kind != EMULATED and kind in self.emulated_kinds

    def _engine(self, record: ModelRecord, kind: str) -> str:
        return EMULATED if self._emulates(record, kind) else engine_for(record.kind, kind)

    def _shape(self, record: ModelRecord) -> str:
        """A real model's emulated name: its architecture, read once from its registered file."""
        if record.uid not in self._shapes:
            from mesh.engines.emulation import shape_name
            from mesh.modelfiles.shape import architecture_of

            try:
                self._shapes[record.uid] = shape_name(architecture_of(record.path, record.uid))
            except (OSError, ValueError) as exc:
                raise ApiError(503, f"The model's shape cannot be read for its emulated nodes: {exc}", "server_error",
                               "model", "model_load_failed") from exc
        return self._shapes[record.uid]

    def check_servable(self, record: ModelRecord) -> None:
        """Raise unless a kind of node the policy uses can run the model now: a 503 while
        its nodes are down or its format for them is being prepared, a 400 if it can never
        run here (what it would need is said)."""
        usable = self.dispatcher.policy.kinds
        if any(k in usable for k in self._kinds_up(record)):
            return
        here = {n.kind for n in self._nodes()}
        ready = [k for k in self.runnable_kinds(record) if k in usable and k in here]
        if ready:
            states = ", ".join(f"{n.node_id} {n.agent.state}" for n in self._nodes() if n.kind in ready)
            raise node_unavailable(f"no {'/'.join(k.upper() for k in ready)} node agent is up ({states})")
        formats = self.model_formats(record)
        for kind in usable:
            if kind in here and formats.get(kind, {}).get("state") == "preparing":
                raise model_preparing(f"its {FORMAT_NAMES[formats[kind]['format']]} for {kind.upper()} nodes is being "
                                      f"prepared from the registered {FORMAT_NAMES[record.kind]}")
        native = record.native_kind
        if native in usable and native not in here and native == CPU:  # CPU nodes come and go (Ray membership)
            raise node_unavailable("no CPU node agent is up (none configured)")
        if native not in here:  # a server without GPUs does not gain one
            why = f"and this server has no {native.upper()} node"
        else:
            why = (f"which the placement policy {self.dispatcher.policy.name} does not use (it uses "
                   f"{'/'.join(k.upper() for k in usable)} nodes)")
        other = [f"its {k.upper()} format: {f['state']}" + (f" ({f['reason']})" if f.get("reason") else "")
                 for k, f in formats.items() if k != native]
        raise bad_request(f"{FORMAT_NAMES[record.kind]}s run on {native.upper()} nodes ({ENGINE_OF_KIND[native]}), "
                          f"{why}; " + "; ".join(other) + ".", "model")

    def _describer(self, record: ModelRecord, kind: str) -> AgentNode:
        """The node of `kind` that describes the model (and so builds it ahead, on a CPU node):
        one that holds its weights there (the first host copy, BlitzScale 5.3: where the
        dispatcher's locality puts its first instance, and no copy to make), else a local
        agent (it reads the registry's path), else any that is up."""
        up = sorted((n for n in self._nodes() if n.kind == kind and n.up), key=lambda n: n.agent.remote)
        if self.weights is not None and record.kind != EMULATED and not self._emulates(record, kind):
            try:
                held = set(self.weights.holders(ModelFormat.of(record, kind).key))
            except KeyError:  # no format for that kind (yet)
                return up[0]
            return next((n for n in up if n.node_id in held), up[0])
        return up[0]

    def model_formats(self, model: ModelRecord) -> dict[str, dict[str, Any]]:
        if self.formats is not None:
            return self.formats.view(model)
        return formats_view(model, "this server prepares no formats", False)

    async def _describe(self, record: ModelRecord) -> DescribedModel:
        """Describe the model on an agent of each kind of node that can run it now (its
        shape in that kind's format), and give the cluster a profile per kind: the
        dispatcher chooses among them. The first kind's agent (CPU first) tokenizes."""
        kinds = self._kinds_up(record)
        if not kinds:
            self.check_servable(record)  # raises the clear 400/503
            raise node_unavailable(f"no node agent that can run {record.name} is up")
        profiles: dict[str, Any] = {}
        vocabs: list[Any] = []
        front: tuple[AgentNode, str] | None = None
        for kind in kinds:
            node = self._describer(record, kind)
            try:
                path, _ = await self._copy_on(record, node)
                shape = await node.agent.client.call(Describe(
                    record.uid, path, self._engine(record, kind), record.context_length,
                    # what a load would ask for: the agent builds that instance ahead and parks it
                    self.cluster.config.max_batch, self.exact_moves), CALL_TIMEOUT_S)
            except (ApiError, AgentCallError, AgentDown) as exc:
                if front is not None:  # the kinds described so far serve; this one is left out
                    log.warning("model %s/%s is not run on %s nodes: describing it on %s failed: %s", record.tenant,
                                record.name, kind.upper(), node.node_id, exc)
                    continue
                if isinstance(exc, ApiError):
                    raise
                if isinstance(exc, AgentCallError):  # its text names server paths: logged, not told
                    log.error("model %s/%s: describing it on %s failed: %s", record.tenant, record.name,
                              node.node_id, exc)
                    raise ApiError(503, f"Model {record.name} cannot be read on node {node.node_id}; the operator's "
                                   "log has the detail.", "server_error", "model", "model_load_failed") from exc
                raise node_unavailable(str(exc)) from exc
            profiles[kind] = self._profile(record, kind, shape)
            vocabs.append(shape.vocab_size)
            front = front or (node, path)
        # An emulated model's base is its catalog model ("llama-2-7b"), as a replay's replicas'
        # are: what the policies look up by base (ServerlessLLM's concurrency targets, 8.1)
        # is then the replay's, not a target tailored to an unknown model.
        base = record.path if record.kind == EMULATED else record.uid
        self.cluster.add_model(record.uid, ModelSpec(base, profiles), MEAN_OUTPUT_PRIOR, record.slo)
        self.cluster.set_cold_start_choice(record.uid, record.cold_start)
        self.cluster.set_admission(record.uid, record.admission)
        known = [int(v) for v in vocabs if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        model = DescribedModel(record, front[0].node_id, front[1], tuple(profiles), min(known) if known else None)
        self.models[record.uid] = model
        return model

    def _profile(self, record: ModelRecord, kind: str, shape: DescribeReply) -> Any:
        """What the dispatcher plans the model's instances with: its calibration profile
        if there is one for this kind of node, else the prior the agents validate with."""
        # an emulated model: its catalog profile on the node's device (mesh.engines.emulation)
        if shape.profile is not None:
            from mesh.perf.profile import profile_from_dict

            return profile_from_dict(shape.profile, f"{record.name} on {kind} nodes")
        path = self.profile_for(record.uid, kind)
        if path is not None:
            from mesh.perf.profile import load_profile

            return load_profile(path)
        return prior_profile(record.uid, kind, shape.weight_bytes, shape.kv_bytes_per_token, shape.context_window)

    def profile_for(self, model_uid: str, kind: str) -> str | None:
        """The model's calibration profile for `kind` nodes: `<dir>/<uid>.<kind>.json`,
        else `<dir>/<uid>.json`, whichever is a profile of that kind (a model that runs on
        both kinds has one per kind); None if neither is. An emulated model's is its catalog
        name, which each agent resolves on the device it emulates (mesh.engines.emulation)."""
        model = self.models.get(model_uid)
        if model is not None and model.record.kind == EMULATED:
            return PROFILE_PREFIX + model.record.path
        if model is not None and self._emulates(model.record, kind):
            return PROFILE_PREFIX + self._shape(model.record)
        if not self.profile_dir:
            return None
        for name in (f"{model_uid}.{kind}.json", f"{model_uid}.json"):
            candidate = Path(self.profile_dir) / name
            if candidate.is_file() and self._profile_kind(candidate) == kind:
                return str(candidate)
        return None

    def _profile_kind(self, path: Path) -> str | None:
        """The device kind of a profile file (read once per version of the file)."""
        from mesh.perf.profile import ProfileError, load_profile

        key = (str(path), path.stat().st_mtime_ns)
        if key not in self._profile_kinds:
            try:
                self._profile_kinds[key] = load_profile(path).device_kind
            except ProfileError as exc:
                log.warning("cannot use profile %s: %s", path, exc)
                self._profile_kinds[key] = None
        return self._profile_kinds[key]

    async def _copy_on(self, record: ModelRecord, node: AgentNode) -> tuple[str, str]:
        """The weights of the model's format for `node`'s kind as `node` sees them and how
        they got there: its own copy (multicast there first if needed) or, without a weights
        plane, the registry's (or the prepared) path."""
        if record.kind == EMULATED:  # a catalog name: nothing to carry, the node emulates it
            return record.path, EMULATED
        if self._emulates(record, node.kind):  # its shape: nothing to carry either
            return self._shape(record), EMULATED
        fmt = ModelFormat.of(record, node.kind)
        if self.weights is None or not self.weights.carries(fmt):
            return fmt.path, "registry path" if fmt.native else "prepared path"
        try:
            copy = await self.weights.copy_on(fmt, node.node_id)
        except WeightsError as exc:  # its text names paths and file facts: logged, not told
            log.error("model %s/%s: its weights could not reach node %s: %s", record.tenant, record.name,
                      node.node_id, exc)
            raise ApiError(503, f"The model's weights could not reach node {node.node_id}; the operator's log has "
                           "the detail. Retry shortly.", "server_error", "model", "weights_unavailable") from exc
        return copy.path, copy.how

    async def load_spec(self, plan: InstancePlan, node: AgentNode) -> InstanceSpec:
        """How `node`'s agent loads the planned instance (the dispatcher chose the node)."""
        record = self.models[plan.model].record
        try:
            path, self._origins[plan.instance_id] = await self._copy_on(record, node)
            profile = self.profile_for(record.uid, node.kind)
        except ApiError as exc:  # told to tenants redacted: the node logs the operator's detail, its cause
            raise StartRefused(str(exc.__cause__ if exc.__cause__ is not None else exc)) from exc
        emulates = record.kind == EMULATED or self._emulates(record, node.kind)
        return InstanceSpec(plan.instance_id, record.uid, path, record.context_length, slo_to_dict(record.slo),
                            plan.max_batch, profile, self._engine(record, node.kind), exact_moves=self.exact_moves,
                            **(self.emulated_loads.spec_fields(plan, node) if emulates else {}))

    def holds_copy(self, model_uid: str, node: Any) -> bool:
        """Does `node` hold the model's weights for its kind (no transfer before a load)? Yes
        without a weights plane (nodes read the registry's path)."""
        model = self.models.get(model_uid)
        if self.weights is None or model is None or model.record.kind == EMULATED or node.kind in self.emulated_kinds:
            return True
        try:
            fmt = ModelFormat.of(model.record, node.kind)
        except KeyError:
            return True
        return not self.weights.carries(fmt) or node.node_id in self.weights.holders(fmt.key)

    def model_registered(self, model: ModelRecord) -> None:
        if model.kind == EMULATED:  # no file: nothing to prepare or to place
            return
        if self.formats is not None:
            self.formats.ensure(model)
        task = asyncio.get_running_loop().create_task(self._first_copy_then_describe(model),
                                                      name=f"first copy {ModelFormat.of(model).key}")
        self._registering[model.uid] = task  # a deletion meanwhile cancels it
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda t, uid=model.uid: self._registering.pop(uid, None)
                               if self._registering.get(uid) is t else None)

    def format_ready(self, model: ModelRecord, kind: str) -> None:
        """A format prepared for `kind` is ready: it joins the parameter pool (its first host
        copy on a node of that kind); the model's next request describes it there too."""
        fmt = ModelFormat.of(model, kind)
        self._spawn(self._first_copy(fmt), f"first copy {fmt.key}")

    async def _first_copy(self, fmt: ModelFormat) -> None:
        """Place the first host copy of a model's format (none without a weights plane)."""
        if self.weights is None or not self.weights.carries(fmt):
            return
        try:
            await self.weights.register(fmt)
        except WeightsError as exc:  # the first request tries again
            log.warning("placing the first host copy of %s (%s nodes) failed: %s", fmt.label, fmt.node_kind, exc)

    async def _first_copy_then_describe(self, model: ModelRecord) -> None:
        """A model just registered: its first host copy, then its description on its nodes
        (its shape, its tokenizer and, on CPU nodes, its first instance built and parked:
        mesh.node.park_ahead), all before its first request, which would otherwise wait for them."""
        await self._first_copy(ModelFormat.of(model))
        try:
            await self.described(model)
        except ApiError as exc:  # its first request describes it again, and says why it cannot
            log.warning("describing %s/%s at its registration failed: %s", model.tenant, model.name, exc.message)

    async def forget_model(self, model_uid: str, then: Callable[[], None] | None = None) -> None:
        """Every trace of a deleted model goes: its registration's work under way, its idle
        instances now and its busy ones once their requests end, its node copies when no
        instance reads them (now, or once a busy one or a load being issued has ended: a copy
        removed under a load failed it); then, with none left, its spec and books in the cluster, its decision lock, and
        its state on every agent (`_forget_when_idle`), and `then()` is called (the service's metric series go). The
        cluster keeps its spec until then: requests for it still in flight are planned with it."""
        registering = self._registering.pop(model_uid, None)
        if registering is not None:
            registering.cancel()
        self.models.pop(model_uid, None)
        self._shapes.pop(model_uid, None)
        for ref in list(self.cluster.instances_of(model_uid)):
            if not ref.requests:
                await self.cluster.stop_instance(ref)
        if self.weights is not None and not self.cluster.instances_of(model_uid) \
                and not self.cluster.issuing(model_uid):  # else once no instance reads them (_forget_when_idle)
            await self.weights.forget(model_uid)
        if self.formats is not None:
            await self.formats.forget(model_uid)
        self._spawn(self._forget_when_idle(model_uid, then), f"forget {model_uid}")

    async def _forget_when_idle(self, model_uid: str, then: Callable[[], None] | None, every_s: float = 0.5) -> None:
        """Once the deleted model's requests have ended (its busy instances are stopped as they
        go idle, not kept alive), it leaves the cluster, the dispatcher and the agents."""
        while True:
            pending = self._describing.get(model_uid)
            if pending is not None:
                await asyncio.wait([pending])
            self.models.pop(model_uid, None)  # a description that ended meanwhile
            for ref in list(self.cluster.instances_of(model_uid)):
                if not ref.requests:
                    await self.cluster.stop_instance(ref)
            # requests in flight first (they are planned with its spec), then its instances
            if model_uid not in self._describing and model_uid not in self._arriving \
                    and self.dispatcher.forget_model(model_uid) \
                    and self.cluster.forget_model(model_uid):
                break
            await asyncio.sleep(every_s)
        if self.weights is not None:  # its node copies, if a busy instance or a load being issued kept them
            await self.weights.forget(model_uid)
        await asyncio.gather(*(node.forget_model(model_uid) for node in self._nodes()))
        if then is not None:
            then()

