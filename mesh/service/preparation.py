"""One registration, both kinds of node: the service prepares each kind's format once.

A tenant registers one format: a GGUF file or an OpenVINO IR folder (CPU nodes, OpenVINO)
or a Hugging Face folder (GPU nodes, vLLM). `FormatPreparer` prepares the other kind's
format in the background after registration (and, for models that lack it, when the
service starts or on the model's first use):

- GGUF -> Hugging Face folder for GPU nodes: `python -m mesh.modelfiles.convert gguf-to-hf`, run
  with the vLLM environment's Python (mesh.engines.vllm_engine.find_vllm_python: it needs torch,
  transformers, gguf and accelerate, which Mesh's own environment does not have), when the
  server has a GPU node (or `--vllm-cpu`'s node) and that Python exists;
- Hugging Face folder -> OpenVINO IR for CPU nodes: `python -m mesh.modelfiles.convert hf-to-ir`
  (optimum-intel), run with the export environment's Python (`.venv-export`, created by
  `MESH_WITH_EXPORT=1 scripts/setup.sh`: the `export` extra's transformers pin conflicts
  with vLLM's), when the server has a CPU node; without that environment such a model runs
  on GPU nodes only, and its view says why;
- OpenVINO IR: CPU nodes only (nothing converts IR into a format vLLM loads).

A prepared copy lives in `<data dir>/prepared/<model uid>/<node kind>/`; its state is in the
registry (`prepared_formats`: preparing, ready, or failed with the reason), so it survives
restarts; it is deleted with the model. A failed preparation is tried again at the next
start of the service, not on every request. Once ready, the cluster control puts the copy into
the parameter pool (its first host copy on a node of its kind, multicasts from there), and
the model's `ModelRecord.node_kinds` includes that kind: the cluster control describes the model
on it, the dispatcher gets a profile for it and chooses the kind (mesh.service.cluster_control).

Conversions run one at a time, at idle CPU priority (SCHED_IDLE, nice 19) with one compute
thread, in a session of their own whose autogroup is at nice 19 and ending with the service
(convert --background, mesh.background), each with a log in
`<data dir>/logs/prepare-<model uid>-<kind>.log`. A model whose registered file has the same
sha256 as one whose copy is ready (the same model registered again, by another tenant or as
a live replay's replicas) gets that copy's files as hard links instead of a conversion (22 s
of CPU for the demo model here).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mesh.modelfiles.formats import CONVERSIONS, EMULATED, ENGINE_OF_KIND, FORMAT_NAMES, Conversion
from mesh.service.registry import ModelRecord, PreparedFormat, Registry
from mesh.tasks import cancel_all

log = logging.getLogger(__name__)

def formats_view(record: ModelRecord, blocked: str, under_way: bool) -> dict[str, dict[str, Any]]:
    """Each kind of node's format of `record`: the registered one (ready), and the other
    kind's with its state: ready, preparing or failed (the registry's), or unavailable with
    the reason. `blocked`: why it cannot be prepared here ("" if it can); `under_way`: a
    preparation runs in this process. A `preparing` row left by a stopped service counts as
    preparing while it can be prepared (the next start or use does it)."""
    if record.kind == EMULATED:  # runs as registered on both kinds of emulated node
        return {k: {"format": EMULATED, "engine": EMULATED, "source": "registered", "state": "ready"}
                for k in record.node_kinds}
    out: dict[str, dict[str, Any]] = {
        record.native_kind: {"format": record.kind, "engine": ENGINE_OF_KIND[record.native_kind],
                             "source": "registered", "state": "ready"}}
    conversion = CONVERSIONS[record.kind]
    kind = conversion.node_kind
    entry: dict[str, Any] = {"format": conversion.format, "engine": ENGINE_OF_KIND[kind], "source": "prepared"}
    prepared = record.prepared_for(kind)
    if prepared is not None and (prepared.state != "preparing" or under_way or not blocked):
        entry.update(state=prepared.state, reason=prepared.reason, weight_bytes=prepared.weight_bytes,
                     seconds=prepared.seconds)
    else:
        entry.update(state="unavailable" if blocked else "preparing", reason=blocked)
    out[kind] = entry
    return out


class ConversionFailed(RuntimeError):
    """A conversion did not produce its output; the message says why (and where its log is)."""


@dataclass
class ConvertTool:
    """Runs `python -m mesh.modelfiles.convert` in a subprocess with the Python that has what the
    conversion needs. Tests replace `run` with a fake converter."""

    background: bool = True  # idle priority and one compute thread (convert --background)
    timeout_s: float = 3600.0

    def python(self, conversion: Conversion) -> tuple[str | None, str]:
        """(the interpreter for `conversion`, or None and why there is none)."""
        if conversion.command is None:
            return None, conversion.missing
        if conversion.command == "hf-to-ir":
            from mesh.modelfiles.convert import find_export_python

            python = find_export_python()
            if python is None:
                return None, ("exporting a Hugging Face folder to OpenVINO IR needs the export extra (optimum-intel) "
                              "in its own environment, which is not installed: run `MESH_WITH_EXPORT=1 "
                              "scripts/setup.sh` (creates .venv-export) or set MESH_EXPORT_PYTHON")
            return python, ""
        from mesh.engines.vllm_engine import find_vllm_python

        python = find_vllm_python()
        if python is None:
            return None, ("converting a GGUF file for vLLM needs vLLM's environment (.venv-vllm: torch, "
                          "transformers, gguf), which is not installed; run scripts/setup.sh")
        return python, ""

    async def run(self, conversion: Conversion, python: str, source: str, out: Path, log_path: Path) -> dict[str, Any]:
        """Convert `source` into `out` (created atomically by the converter); the
        converter's summary, or ConversionFailed."""
        from mesh.engines.worker_process import REPO_ROOT, background_env, worker_env

        cmd = [python, "-m", "mesh.modelfiles.convert", str(conversion.command), source, str(out)]
        cmd += ["--background"] if self.background else []
        env = (background_env if self.background else worker_env)(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            log_file.write(f"$ {' '.join(cmd)}\n".encode())
            log_file.flush()
            proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                                                        env=env, cwd=str(REPO_ROOT))
            try:
                stdout, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
            except BaseException as exc:  # timed out, or the service stops: the conversion stops too
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                if isinstance(exc, asyncio.TimeoutError):
                    raise ConversionFailed(f"{conversion.command} took longer than {self.timeout_s:.0f} s and was "
                                           f"stopped (log: {log_path})") from exc
                raise
        if proc.returncode != 0:
            raise ConversionFailed(f"{conversion.command} failed: {_last_error(log_path)} (log: {log_path})")
        try:
            return json.loads(stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ConversionFailed(f"{conversion.command} ended without its summary (log: {log_path})") from exc


def _clear(out: Path) -> None:
    """Remove an output folder and the converter's temporary folders beside it."""
    from mesh.modelfiles.convert import TEMP_MARK

    for path in [out, *out.parent.glob(f".{out.name}{TEMP_MARK}*")]:
        shutil.rmtree(path, ignore_errors=True)


def _link(source: str, target: str) -> None:
    """Hard-link a prepared file into another model's copy (each model deletes its own
    links), or copy it where links cannot go (another file system)."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _last_error(log_path: Path) -> str:
    """The converter's own message ("convert: ..."), else the last line of its log."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    mine = [ln for ln in lines if ln.startswith("convert: ")]
    return (mine[-1][len("convert: "):] if mine else (lines[-1] if lines else "no output"))[:600]


@dataclass
class FormatPreparer:
    """Prepares, records and forgets the formats of registered models (module docstring)."""

    registry: Registry
    data_dir: Path
    tool: ConvertTool = field(default_factory=ConvertTool)
    enabled: bool = True  # False (`mesh serve --no-prepare`): every model runs on its registered format's kind
    # Set by the cluster control: the kinds of node the server has, and what to do when a format is ready.
    kinds: Callable[[], set[str]] = field(default=lambda: set())
    on_ready: Callable[[ModelRecord, str], None] | None = None
    _tasks: dict[tuple[str, str], asyncio.Task] = field(default_factory=dict)
    _tried: set[tuple[str, str]] = field(default_factory=set)  # prepared (or failed) by this process
    _pythons: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    _one_at_a_time: asyncio.Lock = field(default_factory=asyncio.Lock)

    def folder(self, model_uid: str) -> Path:
        return self.data_dir / "prepared" / model_uid

    # ---- what a model gets ----------------------------------------------------------------
    def blocked(self, record: ModelRecord) -> str:
        """Why the other kind's format of `record` cannot be prepared on this server ("" if it can)."""
        if record.kind == EMULATED:
            return "an emulated model needs no format"
        conversion = CONVERSIONS[record.kind]
        if conversion.command is None:
            return conversion.missing
        if not self.enabled:
            return "preparing formats is off on this server (mesh serve --no-prepare)"
        if conversion.node_kind not in self.kinds():
            return f"this server has no {conversion.node_kind.upper()} node"
        return self._python(conversion)[1]

    def _python(self, conversion: Conversion) -> tuple[str | None, str]:
        if conversion.command not in self._pythons:  # looked up once: it scans sys.path
            self._pythons[str(conversion.command)] = self.tool.python(conversion)
        return self._pythons[str(conversion.command)]

    def view(self, record: ModelRecord) -> dict[str, dict[str, Any]]:
        """Each kind of node's format of `record` and its state (`formats_view`)."""
        if record.kind == EMULATED:
            return formats_view(record, "", False)
        under_way = (record.uid, CONVERSIONS[record.kind].node_kind) in self._tasks
        return formats_view(record, self.blocked(record), under_way)

    # ---- preparing ------------------------------------------------------------------------
    def ensure(self, record: ModelRecord) -> None:
        """Prepare what `record` lacks, in the background (a no-op when it has it, when it
        is under way, or when this process already tried)."""
        if record.kind == EMULATED:
            return
        conversion = CONVERSIONS[record.kind]
        kind = conversion.node_kind
        key = (record.uid, kind)
        if key in self._tasks or key in self._tried:
            return
        prepared = record.prepared_for(kind)
        if prepared is not None and prepared.ready and Path(prepared.path).exists():
            self._tried.add(key)  # nothing to do for it in this process
            return
        if self.blocked(record):
            return
        python = self._python(conversion)[0]
        task = asyncio.get_running_loop().create_task(self._prepare(record, conversion, str(python)),
                                                      name=f"prepare {record.uid} {kind}")
        self._tasks[key] = task
        task.add_done_callback(lambda _t: self._tasks.pop(key, None))

    def ensure_all(self) -> None:
        """Every registered model (at start, and when a node of a new kind joins)."""
        for record in self.registry.models():
            self.ensure(record)

    async def _prepare(self, record: ModelRecord, conversion: Conversion, python: str) -> None:
        kind = conversion.node_kind
        out = self.folder(record.uid) / kind
        label = f"{record.tenant}/{record.name}"
        if not self.registry.set_prepared(record.uid, PreparedFormat(kind, conversion.format, str(out), "preparing")):
            return  # deleted meanwhile
        async with self._one_at_a_time:
            self._tried.add((record.uid, kind))
            loop = asyncio.get_running_loop()
            started = loop.time()
            log.warning("model %s: preparing its %s for %s nodes (%s)", label, FORMAT_NAMES[conversion.format],
                        kind.upper(), conversion.command)
            await asyncio.to_thread(_clear, out)  # what a killed run may have left
            log_path = self.data_dir / "logs" / f"prepare-{record.uid}-{kind}.log"
            twin = self._twin(record, kind)
            try:
                if twin is not None:  # the same file, already converted
                    await asyncio.to_thread(shutil.copytree, twin.path, out, copy_function=_link)
                    summary = {"weight_bytes": twin.weight_bytes}
                else:
                    summary = await self.tool.run(conversion, python, record.path, out, log_path)
            except (ConversionFailed, OSError) as exc:
                log.warning("model %s: preparing its %s format failed: %s", label, kind.upper(), exc)
                self.registry.set_prepared(record.uid, PreparedFormat(kind, conversion.format, str(out), "failed",
                                                                      str(exc)))
                return
            seconds = round(loop.time() - started, 2)
        weight_bytes = int(summary.get("weight_bytes") or 0)
        if not self.registry.set_prepared(record.uid, PreparedFormat(kind, conversion.format, str(out), "ready", "",
                                                                     weight_bytes, seconds)):
            await asyncio.to_thread(shutil.rmtree, self.folder(record.uid), True)  # the model was deleted meanwhile
            return
        log.warning("model %s: its %s for %s nodes is ready (%.1f s, %d bytes of weights)", label,
                    FORMAT_NAMES[conversion.format], kind.upper(), seconds, weight_bytes)
        fresh = self.registry.model_by_uid(record.uid)
        if fresh is not None and self.on_ready is not None:
            self.on_ready(fresh, kind)

    def _twin(self, record: ModelRecord, kind: str) -> PreparedFormat | None:
        """A ready copy for `kind` of another model registered with the same file (sha256)."""
        if not record.sha256:
            return None
        for other in self.registry.models():
            if other.uid != record.uid and other.sha256 == record.sha256 and other.kind == record.kind:
                prepared = other.prepared_for(kind)
                if prepared is not None and prepared.ready and Path(prepared.path).is_dir():
                    return prepared
        return None

    async def forget(self, model_uid: str) -> None:
        """The model was deleted: stop its preparations and delete its prepared copies (the
        registry's rows went with the model)."""
        await cancel_all([t for (uid, _), t in self._tasks.items() if uid == model_uid])
        self._tried = {k for k in self._tried if k[0] != model_uid}
        await asyncio.to_thread(shutil.rmtree, self.folder(model_uid), True)

    async def stop(self) -> None:
        """Stop the conversions under way (their rows stay `preparing`: the next start prepares again)."""
        await cancel_all(list(self._tasks.values()))  # (a cancellation one swallowed is sent again)

    async def wait(self) -> None:
        """Until no preparation is under way (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
