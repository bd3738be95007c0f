"""A node's own cache of prepared models: compile once per node, not once per load.

A GGUF is converted once to OpenVINO IR (`openvino_model.xml/.bin`) with the tokenizer and
detokenizer saved as IR beside it (`openvino_tokenizer.xml`, `openvino_detokenizer.xml`),
in a folder of the node's cache keyed by the file's identity and the OpenVINO version.
Loads then build the pipeline from that folder and the tokenizer from its IR (0.1 s
instead of 1.3-2.6 s for the demo GGUF), and the node's tokenizer worker reuses it too.

Layout under the root (`mesh.paths.data_dir()/compiled` unless told otherwise):

    models/<openvino version>-<source key>/   a prepared model, with prepared.json (written last)
    models/.tmp-*/                            a preparation in progress (never read)
    blobs/<openvino version>/<properties key>/  CACHE_DIR for one device and property set
    blob-import-<openvino version>-<device>.json  whether this OpenVINO can import its own blob

Why the compiled-blob cache is keyed here too, though OpenVINO keys its blobs itself: a
stale blob must never load after an OpenVINO upgrade or with other properties (device, KV
cache precision, inference precision...), and separate folders make that true whatever
OpenVINO's own hash covers, and let old versions' blobs be deleted by folder.

Why the blob cache is probed before it is used: OpenVINO 2026.4.1's CPU plugin writes the
blob of a ContinuousBatchingPipeline's model but cannot import it (the paged-attention
nodes lose the runtime info `k_head_size`/`num_k_heads` in the blob: "PagedAttentionExtension
node ... Runtime info k_head_size and num_k_heads are required"); the pipeline then
compiles again and rewrites the 135 MB blob at every load, which costs more than no cache.
So `prepare` tries to import one blob once per OpenVINO version and device, records the
answer, and loads pass CACHE_DIR only where the import works (a later OpenVINO).

Bounded: every copy a node receives is a new file (a new mtime, so a new folder here), so
without pruning a node that receives models for a day holds tens of GB of them. Each folder's manifest names its
source's path; before a new preparation, `prune` removes the folders whose source is gone or changed (the model deleted,
its copy dropped, the file rewritten), and those of older manifests without a path once they are a
day old. A folder whose source is still there is kept: any load of it may use it.

Atomic writes: a model is prepared in a temporary folder beside its final place, its
manifest written last, then renamed into place; a crash leaves only a `.tmp-*` folder,
which lookups never read. A folder whose manifest is missing, unreadable, or whose files
do not have the sizes it lists is treated as absent, and `prepare` replaces it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

FORMAT = 1  # of prepared.json; a change makes older folders absent
MANIFEST = "prepared.json"
IR_FILES = ("openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_tokenizer.bin",
            "openvino_detokenizer.xml", "openvino_detokenizer.bin")
_TMP = ".tmp-"
_STALE_TMP_S = 3600.0  # a .tmp folder this old belongs to a preparation that died
_STALE_UNNAMED_S = 86400.0  # a prepared folder whose manifest names no source path, pruned at this age


@dataclass(frozen=True, slots=True)
class SourceIdentity:
    """What identifies a model file's content without reading it: a copy received again, or
    a file rewritten, gets a new mtime and so a new entry (never a stale one)."""

    name: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> "SourceIdentity":
        st = path.stat()
        return cls(path.name, st.st_size, st.st_mtime_ns)

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A complete prepared folder: the pipeline and the tokenizer load from `path`."""

    path: Path
    source: SourceIdentity
    openvino: str
    files: dict[str, int]


@dataclass(frozen=True, slots=True)
class BlobSupport:
    """Whether this OpenVINO imports the compiled blob of a pipeline's model on a device."""

    openvino: str
    device: str
    works: bool
    error: str = ""


def default_root() -> Path:
    """The node's cache root: `<data dir>/compiled`."""
    from mesh.paths import data_dir

    return data_dir() / "compiled"


def openvino_version() -> str:
    import openvino as ov

    return ov.get_version()


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def _version_tag(version: str) -> str:
    # the full build string ("2026.4.1-22982-e213a147257-releases/2026/4"): a rebuild of the
    # same release gets its own folders too
    return _safe(version)


def prepared_path(source: Path, root: Path | None = None, version: str | None = None) -> Path:
    """Where the prepared form of `source` lives (whether or not it exists yet)."""
    root = Path(root) if root is not None else default_root()
    ident = SourceIdentity.of(Path(source))
    return root / "models" / f"{_version_tag(version or openvino_version())}-{ident.key()}"


def find_prepared(source: str | Path, root: str | Path | None = None,
                  version: str | None = None) -> PreparedModel | None:
    """The complete prepared form of a GGUF `source` for this OpenVINO, or None (never
    prepared, prepared for another OpenVINO or another file content, or incomplete)."""
    source = Path(source)
    version = version or openvino_version()
    try:
        folder = prepared_path(source, Path(root) if root is not None else None, version)
    except OSError:
        return None
    return _read_manifest(folder, SourceIdentity.of(source), version)


def _read_manifest(folder: Path, ident: SourceIdentity, version: str) -> PreparedModel | None:
    try:
        data = json.loads((folder / MANIFEST).read_text())
        if data.get("format") != FORMAT or data.get("openvino") != version:
            return None
        if SourceIdentity(**data["source"]) != ident:
            return None
        files = {str(k): int(v) for k, v in data["files"].items()}
        if set(files) != set(IR_FILES):
            return None
        for name, size in files.items():
            if (folder / name).stat().st_size != size:  # truncated or replaced: not ours to use
                return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if folder.exists():
            log.warning("ignoring the prepared model in %s: %s", folder, exc)
        return None
    return PreparedModel(folder, ident, version, files)


def tokenizer_path(source: str | Path, root: str | Path | None = None) -> str:
    """What to build a model's tokenizer from: its prepared folder (tokenizer IR, about 0.1 s)
    when there is one, else the model itself (a GGUF's tokenizer is built from its metadata,
    1.3-2.6 s for the demo)."""
    p = Path(source)
    if p.is_file():
        prepared = find_prepared(p, root)
        if prepared is not None:
            return str(prepared.path)
    return str(p)


def prepare(source: str | Path, root: str | Path | None = None, *, device: str = "CPU",
            probe_blobs: bool = True, threads: int | None = None) -> PreparedModel:
    """Convert a GGUF to the node's prepared form (IR + tokenizer IR) unless it is there.

    Seconds of work (the demo: about 4-6 s on 2 cores); meant for a background process
    (engines.prepare_worker), never a request's path. Atomic: see the module docstring.
    With `probe_blobs`, also finds out once per OpenVINO version and device whether
    compiled blobs import (`blob_support`). `threads`: the compile's inference threads
    (a background preparation: 1; the IR it writes is the same)."""
    import openvino_genai as ov_genai

    source = Path(source).resolve()
    root = Path(root) if root is not None else default_root()
    version = openvino_version()
    found = find_prepared(source, root, version)
    if found is None:
        ident = SourceIdentity.of(source)
        final = prepared_path(source, root, version)
        final.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(final.parent)
        prune(root)
        tmp = final.parent / f"{_TMP}{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            link = tmp / "model.gguf"  # GenAI writes the IR next to the file it was given
            link.symlink_to(source)
            tokenizer = ov_genai.Tokenizer(str(link), enable_save_ov_model=True)
            config = ov_genai.SchedulerConfig()
            config.max_num_batched_tokens, config.max_num_seqs = 256, 1
            pipe = ov_genai.ContinuousBatchingPipeline(str(link), tokenizer, config, device,
                                                       enable_save_ov_model=True,
                                                       **({"INFERENCE_NUM_THREADS": threads} if threads else {}))
            del pipe, tokenizer
            link.unlink()
            missing = [n for n in IR_FILES if not (tmp / n).is_file()]
            if missing:
                raise RuntimeError(f"OpenVINO GenAI did not write {', '.join(missing)} for {source}")
            if SourceIdentity.of(source) != ident:
                raise RuntimeError(f"{source} changed while it was prepared")
            files = {n: (tmp / n).stat().st_size for n in IR_FILES}
            _write_json(tmp / MANIFEST, {"format": FORMAT, "openvino": version, "source": asdict(ident),
                                         "source_path": str(source), "files": files, "prepared_at": time.time()})
            _fsync_dir(tmp)
            if final.exists():  # incomplete, or another OpenVINO build's leftovers under our name
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(tmp, final)
            except OSError:  # another preparer got there first: use its folder if complete
                shutil.rmtree(tmp, ignore_errors=True)
            _fsync_dir(final.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        found = find_prepared(source, root, version)
        if found is None:
            raise RuntimeError(f"preparing {source} left no usable folder in {final}")
    if probe_blobs and blob_support(root, device, version) is None:
        probe_blob_import(found, root, device)
    return found


def prune(root: str | Path | None = None, now: float | None = None) -> list[Path]:
    """Remove the prepared folders whose source file is gone or changed, and those whose
    manifest names no source and which are over a day old (module docstring); returns them."""
    models = (Path(root) if root is not None else default_root()) / "models"
    now = time.time() if now is None else now
    removed = []
    try:
        folders = [f for f in models.iterdir() if f.is_dir() and not f.name.startswith(_TMP)]
    except OSError:
        return removed
    for folder in folders:
        try:
            data = json.loads((folder / MANIFEST).read_text())
            path = data.get("source_path")
            if path is None:
                orphan = now - float(data.get("prepared_at", 0.0)) > _STALE_UNNAMED_S
            else:
                orphan = not Path(path).is_file() or SourceIdentity.of(Path(path)) != SourceIdentity(**data["source"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable, or its source vanished between the checks: the next prune decides
        if orphan:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    if removed:
        log.info("node cache %s: removed %d prepared models whose source is gone", models, len(removed))
    return removed


def blob_cache_dir(root: str | Path | None, device: str, properties: Mapping[str, Any], version: str | None = None,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """The CACHE_DIR for one OpenVINO version, device and property set (see the module
    docstring: another version or other properties never see this folder's blobs)."""
    root = Path(root) if root is not None else default_root()
    described = {"device": device, "properties": {str(k): str(v) for k, v in properties.items() if k != "CACHE_DIR"},
                 "extra": {str(k): str(v) for k, v in (extra or {}).items()}}
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]
    return root / "blobs" / _version_tag(version or openvino_version()) / f"{_safe(device)}-{key}"


def _support_path(root: Path, device: str, version: str) -> Path:
    return root / f"blob-import-{_version_tag(version)}-{_safe(device)}.json"


def blob_support(root: str | Path | None, device: str, version: str | None = None) -> BlobSupport | None:
    """The recorded answer of `probe_blob_import` for this OpenVINO and device (None: never probed)."""
    root = Path(root) if root is not None else default_root()
    version = version or openvino_version()
    try:
        data = json.loads(_support_path(root, device, version).read_text())
        support = BlobSupport(**data)
    except (OSError, ValueError, TypeError):
        return None
    return support if support.openvino == version and support.device == device else None


def probe_blob_import(prepared: PreparedModel, root: str | Path | None, device: str = "CPU") -> BlobSupport:
    """Build a pipeline from `prepared` twice with a scratch CACHE_DIR, as loads would: the
    first build writes the blob; if the second imports it, the blob is left as it was, and
    if it cannot (it compiles again) OpenVINO rewrites it. Record and return the answer
    (about 5 s for the demo model, once per OpenVINO version and device).

    Why not `Core.import_model` on the blob file: the cache's files carry a header that
    OpenVINO's cache manager strips, so a direct import fails whatever the plugin can do."""
    import openvino_genai as ov_genai

    root = Path(root) if root is not None else default_root()
    version = openvino_version()
    scratch = root / f"{_TMP}probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    scratch.mkdir(parents=True)

    def build() -> None:
        config = ov_genai.SchedulerConfig()
        config.max_num_batched_tokens, config.max_num_seqs = 256, 1
        tokenizer = ov_genai.Tokenizer(str(prepared.path))
        pipe = ov_genai.ContinuousBatchingPipeline(str(prepared.path), tokenizer, config, device,
                                                   CACHE_DIR=str(scratch))
        del pipe

    def blobs() -> dict[str, tuple[int, int]]:
        return {b.name: (b.stat().st_ino, b.stat().st_mtime_ns) for b in scratch.glob("*.blob")}

    try:
        build()
        first = blobs()
        if not first:
            support = BlobSupport(version, device, False, "the pipeline wrote no blob")
        else:
            build()
            second = blobs()
            support = (BlobSupport(version, device, True) if second == first else
                       BlobSupport(version, device, False, "the second build wrote its blob again: OpenVINO "
                                   "could not import the first one"))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use blobs
        support = BlobSupport(version, device, False, " ".join(str(exc).split())[:500])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _write_json(_support_path(root, device, version), asdict(support))
    if not support.works:
        log.info("OpenVINO %s does not import its %s blobs of pipeline models; loads compile (%s)",
                 version, device, support.error)
    return support


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Write a file whole or not at all (temp file + rename)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_tmp(folder: Path) -> None:
    """Remove `.tmp-*` folders of preparations that died (their process is gone, or they
    are over an hour old): a killed preparer leaves one behind (SIGKILL runs no cleanup)."""
    now = time.time()
    for entry in folder.glob(f"{_TMP}*"):
        try:
            if now - entry.stat().st_mtime > _STALE_TMP_S or not _alive(_tmp_pid(entry.name)):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def _tmp_pid(name: str) -> int | None:
    parts = name.rsplit("-", 2)  # .tmp-<final name>-<pid>-<random>
    try:
        return int(parts[-2]) if len(parts) == 3 else None
    except ValueError:
        return None


def _alive(pid: int | None) -> bool:
    if pid is None or pid == os.getpid():
        return pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
