"""mesh.engines.node_cache: a node's prepared models (GGUF -> IR + tokenizer IR) and the keys of
its compiled-blob cache. Fast tests on fake folders; slow ones on the real demo model."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest

from mesh.engines import node_cache
from mesh.engines.node_cache import IR_FILES, MANIFEST, blob_cache_dir, find_prepared, prepared_path

V1, V2 = "2026.4.1-22982-e213a147257-releases/2026/4", "2026.5.0-1-abc-releases/2026/5"


def _fake_prepared(source: Path, root: Path, version: str, **manifest) -> Path:
    """A complete prepared folder as `prepare` would leave it (files' contents made up)."""
    folder = prepared_path(source, root, version)
    folder.mkdir(parents=True)
    files = {}
    for k, name in enumerate(IR_FILES):
        (folder / name).write_bytes(b"x" * (100 + k))
        files[name] = 100 + k
    (folder / MANIFEST).write_text(json.dumps({"format": node_cache.FORMAT, "openvino": version, "files": files,
                                               "source": {"name": source.name, "size": source.stat().st_size,
                                                          "mtime_ns": source.stat().st_mtime_ns}, **manifest}))
    return folder


def test_prepared_models_whose_source_is_gone_are_pruned(tmp_path: Path) -> None:
    """Every received copy is a new file and a new folder: prune keeps the cache to the
    sources still on the node (a day-old folder of an older manifest, which names none, goes)."""
    root = tmp_path / "cache"
    files = {}
    for name in ("kept", "deleted", "rewritten", "old", "recent"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"GGUF" + name.encode())
    folders = {n: _fake_prepared(f, root, V1, **({"source_path": str(f)} if n not in ("old", "recent") else {}),
                                 prepared_at=1000.0 if n == "old" else 100000.0)
               for n, f in files.items()}
    files["deleted"].unlink()
    os.utime(files["rewritten"], ns=(0, files["rewritten"].stat().st_mtime_ns + 10**9))
    removed = node_cache.prune(root, now=100000.0 + 3600)
    assert sorted(removed) == sorted(folders[n] for n in ("deleted", "rewritten", "old"))
    assert {f.name for f in (root / "models").iterdir()} == {folders[n].name for n in ("kept", "recent")}
    assert find_prepared(files["kept"], root, V1) is not None
    assert node_cache.prune(root, now=100000.0 + 3600) == []  # nothing more


@pytest.fixture
def source(tmp_path: Path) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 60)
    return p


def test_a_complete_folder_is_found_for_its_version_and_file_only(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    folder = _fake_prepared(source, root, V1)
    found = find_prepared(source, root, V1)
    assert found is not None and found.path == folder and found.files["openvino_model.bin"] == 101
    assert find_prepared(source, root, V2) is None  # another OpenVINO: another folder
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert find_prepared(source, root, V1) is None  # the file was rewritten: its old entry is not used
    assert node_cache.tokenizer_path(source, root) == str(source)


@pytest.mark.parametrize("damage", ["truncated", "missing file", "no manifest", "bad manifest", "other version",
                                    "other source"])
def test_a_damaged_folder_is_absent(source: Path, tmp_path: Path, damage: str) -> None:
    root = tmp_path / "cache"
    folder = _fake_prepared(source, root, V1)
    manifest = json.loads((folder / MANIFEST).read_text())
    if damage == "truncated":
        (folder / "openvino_model.bin").write_bytes(b"x")
    elif damage == "missing file":
        (folder / "openvino_detokenizer.xml").unlink()
    elif damage == "no manifest":
        (folder / MANIFEST).unlink()
    elif damage == "bad manifest":
        (folder / MANIFEST).write_text(json.dumps(manifest)[:-10])
    elif damage == "other version":
        manifest["openvino"] = V2
        (folder / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "other source":
        manifest["source"]["size"] += 1
        (folder / MANIFEST).write_text(json.dumps(manifest))
    assert find_prepared(source, root, V1) is None


def test_an_unfinished_preparation_is_never_read(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    folder = _fake_prepared(source, root, V1)
    tmp = folder.with_name(".tmp-" + folder.name + "-1-abc")
    folder.rename(tmp)  # a crash before the rename: the whole folder, manifest included, is still .tmp
    assert find_prepared(source, root, V1) is None


def test_blob_folders_differ_by_version_device_and_properties(tmp_path: Path) -> None:
    base = blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8"}, V1, {"max_num_seqs": 64})
    assert base == blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8"}, V1, {"max_num_seqs": 64})
    others = [
        blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8"}, V2, {"max_num_seqs": 64}),
        blob_cache_dir(tmp_path, "GPU", {"KV_CACHE_PRECISION": "u8"}, V1, {"max_num_seqs": 64}),
        blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "f16"}, V1, {"max_num_seqs": 64}),
        blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8", "INFERENCE_PRECISION_HINT": "f32"}, V1,
                       {"max_num_seqs": 64}),
        blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8"}, V1, {"max_num_seqs": 16}),
    ]
    assert len({base, *others}) == 6
    assert all(not p.is_relative_to(base) and not base.is_relative_to(p) for p in others)  # never nested
    # CACHE_DIR itself is not part of the key (where the cache is does not change the blob)
    assert blob_cache_dir(tmp_path, "CPU", {"KV_CACHE_PRECISION": "u8", "CACHE_DIR": "/x"}, V1,
                          {"max_num_seqs": 64}) == base


def test_blob_support_record_is_per_version(tmp_path: Path) -> None:
    node_cache._write_json(node_cache._support_path(tmp_path, "CPU", V1),
                           {"openvino": V1, "device": "CPU", "works": True, "error": ""})
    assert node_cache.blob_support(tmp_path, "CPU", V1).works
    assert node_cache.blob_support(tmp_path, "CPU", V2) is None  # a new OpenVINO is probed again
    assert node_cache.blob_support(tmp_path, "GPU", V1) is None


# ---- the real demo model ----------------------------------------------------------------

QUESTIONS = ([{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Write a long story about a dragon."}])
TEXTS = ["hello world", "Ünïcødé — 東京 12345 🙂", "  leading spaces\n\ttabs", "<|im_start|>user"]


@pytest.fixture(scope="module")
def prepared(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> node_cache.PreparedModel:
    root = tmp_path_factory.mktemp("node-cache")
    return node_cache.prepare(demo_gguf, root)


def _greedy(engine, messages, max_tokens: int = 16) -> list[int]:
    from mesh.engines.engine_api import EngineRequest, Sampling

    ids = engine.encode_chat(messages)
    engine.add_request(EngineRequest("r", len(ids), Sampling(max_tokens=max_tokens, temperature=0), ids))
    out = []
    while engine.has_work():
        result = engine.step_blocking()
        out += [t for t in result.token_ids if t is not None]
    return out


@pytest.mark.slow
def test_prepare_writes_the_ir_and_a_load_uses_it(demo_gguf: Path, prepared: node_cache.PreparedModel) -> None:
    from mesh.engines.openvino_engine import OpenVINOEngine

    root = prepared.path.parent.parent
    assert all((prepared.path / name).stat().st_size > 0 for name in IR_FILES)
    assert not list(prepared.path.parent.glob(".tmp-*"))  # nothing half-written left behind
    assert find_prepared(demo_gguf, root) == prepared
    manifest = json.loads((prepared.path / MANIFEST).read_text())
    assert manifest["source_path"] == str(demo_gguf.resolve())  # what prune checks
    assert node_cache.prune(root) == [] and find_prepared(demo_gguf, root) == prepared  # its source is there
    assert node_cache.prepare(demo_gguf, root) == prepared  # prepared once: the second call finds it

    fresh = OpenVINOEngine(demo_gguf, context_window=256, max_num_seqs=4, cache_root=root, use_node_cache=False)
    fresh.load_blocking()
    assert fresh.loaded_from == "gguf"
    expected = [_greedy(fresh, q) for q in QUESTIONS]
    del fresh
    cached = OpenVINOEngine(demo_gguf, context_window=256, max_num_seqs=4, cache_root=root)
    cached.load_blocking()
    assert cached.loaded_from == "prepared"
    assert [_greedy(cached, q) for q in QUESTIONS] == expected
    assert all(len(tokens) > 3 for tokens in expected)
    # the blob cache: used exactly where this OpenVINO was found to import its blobs
    support = node_cache.blob_support(root, "CPU")
    assert support is not None
    if support.works:
        assert cached.blob_cache is not None and list(cached.blob_cache.glob("*.blob"))
    else:
        assert cached.blob_cache is None and not (root / "blobs").exists()


@pytest.mark.slow
def test_the_prepared_tokenizer_gives_identical_ids(demo_gguf: Path, prepared: node_cache.PreparedModel) -> None:
    import openvino_genai as ov_genai

    from mesh.engines.chat import PromptEncoder

    root = prepared.path.parent.parent
    assert node_cache.tokenizer_path(demo_gguf, root) == str(prepared.path)
    from_gguf = PromptEncoder(ov_genai.Tokenizer(str(demo_gguf)))
    from_ir = PromptEncoder(ov_genai.Tokenizer(str(prepared.path)))
    for q in QUESTIONS:
        assert from_ir.encode_chat(q) == from_gguf.encode_chat(q)
    for text in TEXTS:
        ids = from_gguf.encode_prompt(text)
        assert from_ir.encode_prompt(text) == ids
        assert from_ir.decode(ids) == from_gguf.decode(ids)
    tok_gguf, tok_ir = ov_genai.Tokenizer(str(demo_gguf)), ov_genai.Tokenizer(str(prepared.path))
    assert (tok_ir.get_eos_token_id(), tok_ir.get_bos_token_id()) == (tok_gguf.get_eos_token_id(),
                                                                       tok_gguf.get_bos_token_id())


@pytest.mark.slow
def test_a_damaged_entry_is_ignored_and_rebuilt(demo_gguf: Path, prepared: node_cache.PreparedModel,
                                                tmp_path: Path) -> None:
    from mesh.engines.openvino_engine import OpenVINOEngine

    root = tmp_path / "cache"
    damaged = prepared_path(demo_gguf, root)
    shutil.copytree(prepared.path, damaged)
    with open(damaged / "openvino_model.bin", "r+b") as f:
        f.truncate(1000)  # a copy cut short (disk full, crash while copying)
    assert find_prepared(demo_gguf, root) is None
    engine = OpenVINOEngine(demo_gguf, context_window=256, max_num_seqs=4, cache_root=root)
    engine.load_blocking()
    assert engine.loaded_from == "gguf"  # the damaged folder was not used
    del engine
    rebuilt = node_cache.prepare(demo_gguf, root, probe_blobs=False)
    assert rebuilt.path == damaged
    bins = [n for n in IR_FILES if n.endswith(".bin")]  # the XMLs name the folder they were written in
    assert {n: rebuilt.files[n] for n in bins} == {n: prepared.files[n] for n in bins}
    assert (damaged / "openvino_model.bin").stat().st_size == prepared.files["openvino_model.bin"]


@pytest.mark.slow
def test_the_worker_engine_loads_the_prepared_form(demo_gguf: Path, prepared: node_cache.PreparedModel,
                                                   tmp_path: Path) -> None:
    from mesh.engines.openvino_process import OpenVINOProcessEngine

    engine = OpenVINOProcessEngine(demo_gguf, context_window=256, max_num_seqs=4, log_dir=tmp_path,
                                   cache_root=prepared.path.parent.parent)

    async def run() -> None:
        await engine.load()
        try:
            assert engine.loaded_from == "prepared"
        finally:
            await engine.unload()

    asyncio.run(run())


@pytest.mark.slow
def test_the_background_preparer_prepares_once_and_stops_at_close(demo_gguf: Path, tmp_path: Path) -> None:
    from mesh.engines.background_prepare import BackgroundPreparer

    root = tmp_path / "cache"

    async def run() -> None:
        stopped = BackgroundPreparer(root)
        assert stopped.schedule(demo_gguf)
        await asyncio.sleep(1.0)  # it is converting
        await stopped.close()  # killed mid-way: nothing usable is left
        assert find_prepared(demo_gguf, root) is None
        preparer = BackgroundPreparer(root)
        assert preparer.schedule(demo_gguf) and not preparer.schedule(demo_gguf)  # queued once
        assert not preparer.schedule(tmp_path)  # not a GGUF: nothing to prepare
        await preparer.wait()
        await preparer.close()
        assert preparer.done == {str(demo_gguf.resolve()): 0}
        assert find_prepared(demo_gguf, root) is not None
        assert not list((root / "models").glob(".tmp-*"))  # the killed one's folder was removed
        assert node_cache.blob_support(root, "CPU") is not None  # probed once for this OpenVINO
        assert not BackgroundPreparer(root).schedule(demo_gguf)  # prepared already

    asyncio.run(run())
