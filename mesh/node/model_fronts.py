"""Models a node agent knows before (or beside) their instances: each model's `front`, an
unloaded engine that reads its shape and tokenizer (`describe`, `tokenize` by path), the
tokenize jobs under way, and `forget`, which drops everything held for a deleted model.

A model new to an OpenVINO node has its tokenizer built in the background when it is
described, and the instance a load would build is built ahead and parked
(mesh.node.park_ahead), so neither lands in its first requests' TTFT.
"""
from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from mesh.engines.background_prepare import BackgroundPreparer
from mesh.engines.emulation import ENGINE as EMULATED
from mesh.engines.engine_api import EngineError
from mesh.engines.openvino_process import OpenVINOProcessEngine
from mesh.node.control_connection import Refused
from mesh.node.engine_host import make_engine
from mesh.node.instance_host import InstanceHost
from mesh.node.tokenizers import TokenizerProcess
from mesh.perf.profile import profile_to_dict
from mesh.wire.agent_protocol import (
    Code,
    Describe,
    DescribeReply,
    Forget,
    ForgetReply,
    InstanceSpec,
    Tokenize,
    TokenizeReply,
)

UNLOAD_WAIT_S = 300.0  # how long a forget waits for the model's unloads under way


class ModelFronts:
    """The fronts of the models described here, their tokenizers and tokenize jobs."""

    def __init__(self, host: InstanceHost, tokenizers: TokenizerProcess, preparer: BackgroundPreparer) -> None:
        self.host = host
        self.tokenizers = tokenizers  # OpenVINO prompts are tokenized off the agent's GIL, each in its turn
        self.preparer = preparer
        # Unloaded engines by (engine, path, window): a model's shape and tokenizer before
        # any instance of it runs here (`describe`, `tokenize` by path).
        self.fronts: dict[tuple[str, str, int | None], Any] = {}
        self._front_models: dict[tuple[str, str, int | None], str] = {}  # front key -> the model it was built for
        self._tokenizer_builds: dict[str, asyncio.Future] = {}  # path -> its tokenizer's build ahead
        self._tokenizing: dict[str, asyncio.Task] = {}  # request id -> the task tokenizing it (abort cancels it)
        self._tokenize_aborted: dict[str, bool] = {}

    async def describe(self, m: Describe) -> DescribeReply:
        engine = await self.front(m)
        profile = None
        if m.engine == EMULATED and self.host.emulation is not None:  # the dispatcher plans with it too
            profile = profile_to_dict(self.host.emulation.profile(m.path))
        return DescribeReply(engine.weight_bytes, engine.kv_bytes_per_token, engine.context_window,
                             getattr(engine, "vocab_size", None), profile)

    async def tokenize(self, m: Tokenize) -> TokenizeReply:
        """A prompt's ids with the tokenizer of an instance (`instance_id`) or, before any
        instance runs here, of the model at `path`. With a `request_id`, an `abort` of that
        request cancels it (its tokenizer job is dropped if it has not run); `tenant` takes
        its turn in the tokenizer's queue (mesh.node.tokenizers)."""
        rid = m.request_id
        if rid is None:
            return await self._tokenize_now(m)
        self._tokenizing[rid] = asyncio.current_task()
        try:
            return await self._tokenize_now(m)
        except asyncio.CancelledError:
            if self._tokenize_aborted.pop(rid, False):
                raise Refused(Code.FAILED, f"tokenizing {rid} was aborted by the control service") from None
            raise
        finally:
            self._tokenizing.pop(rid, None)
            self._tokenize_aborted.pop(rid, None)

    def abort_tokenize(self, request_id: str) -> None:
        """The request was aborted: its tokenize, if still under way, leaves the tokenizer's queue."""
        tokenizing = self._tokenizing.get(request_id)
        if tokenizing is not None:
            self._tokenize_aborted[request_id] = True
            tokenizing.cancel()

    async def _tokenize_now(self, m: Tokenize) -> TokenizeReply:
        if m.instance_id is not None:
            engine, spec = self.host.ready_instance(m.instance_id).engine, self.host.specs[m.instance_id]
        else:
            front = m.front()
            engine = await self.front(front)
            spec = InstanceSpec("front", "model", front.path, engine.context_window, engine=front.engine)
        messages, prompt, tenant = m.messages, m.prompt, m.tenant or ""
        try:
            if spec.engine == "openvino":
                ids = await self.tokenizers.encode(spec.path, messages, prompt, tenant)
            elif spec.engine == EMULATED:  # no tokenizer to run (mesh.engines.emulation)
                ids = engine.encode_chat(messages) if messages is not None else engine.encode_prompt(prompt)
            else:  # vLLM's, in its engine's worker: its turn in the node's queue, off this loop (tokenizers)
                ids = await self.tokenizers.run(
                    tenant,
                    (lambda deadline_s: engine.encode_chat(messages, deadline_s)) if messages is not None else
                    (lambda deadline_s: engine.encode_prompt(prompt, deadline_s)),
                    lambda why: self._restart(m.instance_id, engine, why))
        except EngineError as exc:
            raise Refused(Code.BAD_REQUEST, str(exc)) from exc
        return TokenizeReply(ids)

    async def _restart(self, instance_id: str | None, engine: Any, why: str) -> bool:
        """A vLLM tokenize ran past its deadline (mesh.node.tokenizers): its worker is stuck.
        An instance's fails the watchdog's way (mesh.node.runtime `worker_stuck`: its requests
        are placed again, its worker killed, a new instance starts where needed); a front's
        worker is killed and the front dropped (the next describe or tokenize builds a fresh
        one). Whether a worker was killed."""
        if instance_id is not None:
            inst = self.host.node.instances.get(instance_id)
            return inst is not None and inst.engine is engine and self.host.node.worker_stuck(
                instance_id, f"its tokenizer is stuck ({why})")
        for key, front in list(self.fronts.items()):
            if front is engine:
                del self.fronts[key]
        await asyncio.to_thread(engine.kill_worker)
        return True

    async def front(self, m: Describe) -> Any:
        """The unloaded engine of the model at m's path (built once: it reads the model's
        shape and tokenizer, loads no weights)."""
        spec = InstanceSpec("front", m.model, m.path, m.context_window, engine=m.engine)
        self.host.check_engine(spec.engine)
        if spec.engine != EMULATED:
            self.host.check_path(spec.path)
        key = (spec.engine, spec.path, spec.context_window)
        self._front_models.setdefault(key, spec.model)  # whose front it is (forget)
        if key not in self.fronts:
            try:
                front = (self.host.emulated(spec) if spec.engine == EMULATED else
                         await asyncio.to_thread(make_engine, spec, lambda _exc: None))
            except EngineError as exc:
                raise Refused(Code.BAD_REQUEST, str(exc)) from exc
            if key not in self._front_models:  # its model was forgotten while it was made: nothing of it is kept
                getattr(front, "kill_worker", lambda: None)()
                raise Refused(Code.BAD_REQUEST, f"model {spec.model} was deleted while it was described")
            self.fronts[key] = front
            if isinstance(self.fronts[key], OpenVINOProcessEngine):
                # a model new to this node (described at registration, or at its first request):
                # its tokenizer is built now, in the background, not in its first requests' TTFT
                built = asyncio.ensure_future(self.tokenizers.prepare(spec.path))
                self._tokenizer_builds[spec.path] = built  # a reference (the loop keeps only weak ones), for forget
                built.add_done_callback(partial(self._build_ended, spec.path))
                built.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failure shows at tokenize
                # and the instance a load would build is built now and parked (mesh.node.park_ahead)
                ahead = InstanceSpec(f"ahead-{spec.model}", spec.model, spec.path, spec.context_window,
                                     max_num_seqs=m.max_num_seqs, exact_moves=m.exact_moves)
                self.host.ahead.schedule(ahead, lambda: self._prepared_after(built, spec.path))
        return self.fronts[key]

    def _build_ended(self, path: str, build: asyncio.Future) -> None:
        if self._tokenizer_builds.get(path) is build:
            del self._tokenizer_builds[path]

    async def _prepared_after(self, tokenizer: asyncio.Future, path: str) -> None:
        """Until the model's tokenizer is built and its background preparation (the IR a
        build reads) has ended; not other models' preparations, which may take minutes."""
        await asyncio.wait([tokenizer])
        await self.preparer.wait(path)

    def models_known(self) -> list[str]:
        """Every model this agent holds state for: fronts, means, learnt times, builds ahead,
        parked workers, instances (what a deleted model must leave none of)."""
        host = self.host
        known = set(self._front_models.values())
        known |= set(host.means) | set(host.learning.times) | set(host.ahead.models()) | set(host.parking.models())
        known |= {inst.model for inst in host.node.instances.values()} | {s.model for s in host.specs.values()}
        # an unload under way may park its worker
        known |= {inst.model for inst in host.node.memory_ops.unloading.values()}
        return sorted(known)

    def _unloading(self, model: str) -> bool:
        return any(inst.model == model for inst in self.host.node.memory_ops.unloading.values())

    async def forget(self, m: Forget) -> ForgetReply:
        """A model was deleted from the service: every trace of it here goes (its instances
        were unloaded first): its fronts and tokenizer, mean, learnt times, build ahead and
        parked workers."""
        model = m.model
        if not model:
            raise Refused(Code.BAD_REQUEST, "forget needs the model")
        if any(inst.model == model for inst in self.host.node.instances.values()):
            raise Refused(Code.BUSY, f"model {model} still has instances on {self.host.spec.node_id}")
        # its instances' unloads end first: an unload parks its worker or records learnt times
        # (forgotten below). One waits for its turn among the node's memory operations, which a
        # loaded node makes long; the caller may stop waiting for the answer, the forget goes on.
        deadline = asyncio.get_running_loop().time() + UNLOAD_WAIT_S
        while self._unloading(model) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        paths = set()
        for key, front_model in list(self._front_models.items()):
            if front_model == model:
                del self._front_models[key]
                front = self.fronts.pop(key, None)
                paths.add(key[1])
                if front is not None and hasattr(front, "kill_worker"):
                    front.kill_worker()
        self.host.means.pop(model, None)
        self.host.learning.forget(model)
        self.host.ahead.forget(model)
        self.host.parking.forget(model)
        for path in paths:
            self.preparer.forget(path)
            build = self._tokenizer_builds.pop(path, None)
            if build is not None:  # still waiting for its turn: it leaves the queue, never built
                build.cancel()
            await self.tokenizers.forget(path)
        return ForgetReply(model)
