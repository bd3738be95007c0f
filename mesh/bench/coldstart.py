"""`mesh bench coldstart`: where an OpenVINO instance's cold start goes, stage by stage, for
each source a node can load from.

Sources (rows):
- gguf: the GGUF itself, no node cache (a load before the node has prepared the model);
- ir: the node's prepared form (mesh.engines.node_cache: IR + tokenizer IR), no compiled blob;
- ir+blob: the prepared form with a CACHE_DIR that one untimed load filled first (the
  node's own blob cache). `blob` says whether the timed load left the blob as it was
  (imported) or wrote it again (OpenVINO could not import it and compiled).
- parked: the node's memory tier (mesh.engines.parking): an instance of the model stopped on the
  node earlier, its worker kept built and warm; the load adopts it. Timed in this process
  (a node agent's), from `load()` to ready, then the first token; the other stages are none.
With `--vllm-hf FOLDER` (a Hugging Face folder, e.g. the demo GGUF converted by
`python -m mesh.modelfiles.convert gguf-to-hf`), vLLM's cold start on this machine's vLLM
build is timed too (mesh.engines.vllm_engine, a fresh worker per run): start + import (spawn to
vLLM imported), build (weights, KV cache, vLLM's own warm-up and, on a GPU, torch.compile and
CUDA graph capture), ready, first token.
A copy received by multicast from another node is not a row yet (the transfer is timed by
`mesh bench multicast`; a received GGUF loads as the gguf row until it is prepared).

Every run is a fresh Python process (a new worker, as a node agent starts one per
instance), so nothing is warm but the OS page cache, as on a node that holds the files.
Stages, timed from outside the engine (engines read no clocks): start (process spawn to
the first line of Python), import (openvino_genai and the engine), read (the model's files
read once: from the page cache when the node holds them), tokenizer, build (the pipeline:
convert + compile for a GGUF, compile or blob import for IR), warm-up (one 1-token request:
the first inference's one-time cost and the KV cache's first allocation, which grows on
demand at the first step, so it cannot be timed apart), ready (spawn to ready, the sum),
first token (a 37-token chat prompt's prefill once ready). The preparation itself (once per
node, in the background) is timed once in its own process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from mesh.bench.report import write_json
from mesh.engines.parking import ParkingLot

SOURCES = ("gguf", "ir", "ir+blob")  # each run a fresh process; "parked" is timed in this one
STAGES = ("start", "import", "read", "tokenizer", "build", "warm_up", "ready", "first_token")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KV_BYTES = 64 * 2**20  # the KV cache a node gives the instance after its load (vLLM: raised to its minimum)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One cold load in this (fresh) process; returns its stages in seconds."""
    t0 = time.time()
    stages: dict[str, Any] = {"start": t0 - args.spawned_at}
    p0 = time.perf_counter()
    import openvino_genai  # noqa: F401 - the runtime's import is a stage of its own

    from mesh.engines import node_cache
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.engines.openvino_engine import OpenVINOEngine

    p1 = time.perf_counter()
    stages["import"] = p1 - p0
    root = Path(args.root)
    source = Path(args.model)
    prepared = node_cache.find_prepared(source, root) if args.child != "gguf" else None
    if args.child != "gguf" and prepared is None:
        raise SystemExit(f"no prepared form of {source} in {root}")
    files = [source] if prepared is None else [prepared.path / n for n in node_cache.IR_FILES]
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    p2 = time.perf_counter()
    stages["read"] = p2 - p1
    properties = {"CACHE_DIR": args.blob_dir} if args.blob_dir else {}
    engine = OpenVINOEngine(source, context_window=2048, max_num_seqs=16, cache_root=root, properties=properties,
                            use_node_cache=args.child != "gguf")
    tokenizer = engine.build_tokenizer()
    p3 = time.perf_counter()
    stages["tokenizer"] = p3 - p2
    blobs_before = _blobs(args.blob_dir)
    pipe = engine.build_pipeline(tokenizer)
    p4 = time.perf_counter()
    stages["build"] = p4 - p3
    engine.install(pipe)
    engine.warm_up()
    p5 = time.perf_counter()
    stages["warm_up"] = p5 - p4
    stages["ready"] = stages["start"] + (p5 - p0)
    ids = engine.encode_chat(QUESTION)
    p6 = time.perf_counter()
    engine.add_request(EngineRequest("q", len(ids), Sampling(max_tokens=1, temperature=0), ids))
    while engine.has_work():
        engine.step_blocking()
    stages["first_token"] = time.perf_counter() - p6
    stages["loaded_from"] = engine.loaded_from
    stages["kv_bytes_after_warm_up"] = engine.kv_bytes_allocated()
    if args.blob_dir:
        stages["blob"] = "imported" if blobs_before and _blobs(args.blob_dir) == blobs_before else "rewritten"
    return stages


def _blobs(folder: str | None) -> dict[str, tuple[int, int]]:
    if not folder or not Path(folder).is_dir():
        return {}
    return {b.name: (b.stat().st_ino, b.stat().st_mtime_ns) for b in Path(folder).glob("*.blob")}


def _spawn(*argv: str) -> dict[str, Any]:
    """Run this module in a fresh process; its last stdout line is its JSON answer."""
    cmd = [sys.executable, "-m", "mesh.bench.coldstart", *argv, "--spawned-at", repr(time.time())]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _prepare_child(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    from mesh.engines import node_cache

    prepared = node_cache.prepare(args.model, args.root, probe_blobs=False)
    return {"prepare": time.perf_counter() - t0, "path": str(prepared.path)}


def run(model: Path, runs: int, work: Path, vllm_hf: Path | None = None) -> dict[str, Any]:
    """All rows: {"prepare": s, "sources": {source: {"runs": [...], "stages": {stage: {median,min,max}}}}}."""
    root = work / "node-cache"
    prepared = _spawn("--child-prepare", "--model", str(model), "--root", str(root))
    blob_dir = work / "blobs"
    _spawn("--child", "ir+blob", "--model", str(model), "--root", str(root), "--blob-dir", str(blob_dir))  # fills it
    out: dict[str, Any] = {"model": str(model), "runs": runs, "prepare_s": prepared["prepare"], "sources": {}}
    for k in range(runs):  # interleaved, so that drift on a shared machine hits every row alike
        for source in SOURCES:
            argv = ["--child", source, "--model", str(model), "--root", str(root)]
            if source == "ir+blob":
                argv += ["--blob-dir", str(blob_dir)]
            elif source == "gguf":
                argv[argv.index("--root") + 1] = str(work / f"empty-{k}")  # a fresh, empty cache
            out["sources"].setdefault(source, {"runs": []})["runs"].append(_spawn(*argv))
    out["sources"]["parked"] = {"runs": asyncio.run(_parked_runs(_openvino(model, root), runs))}
    for row in out["sources"].values():
        row["stages"] = {s: _summary([r[s] for r in row["runs"]]) for s in STAGES if s in row["runs"][0]}
        row["loaded_from"] = sorted({r["loaded_from"] for r in row["runs"]})
        if any("blob" in r for r in row["runs"]):
            row["blob"] = sorted({r["blob"] for r in row["runs"]})
    if vllm_hf is not None:
        vruns = asyncio.run(_vllm_runs(vllm_hf, runs))
        parked = asyncio.run(_parked_runs(_vllm(vllm_hf), runs))
        out["vllm"] = {"folder": str(vllm_hf), "runs": vruns,
                       "stages": {s: _summary([r[s] for r in vruns]) for s in VLLM_STAGES},
                       "parked": {"runs": parked, "stages": {s: _summary([r[s] for r in parked])
                                                              for s in ("ready", "first_token")}}}
    return out


async def _parked_runs(make: Callable[[ParkingLot], Any], runs: int) -> list[dict[str, Any]]:
    """Loads that adopt a parked worker: one load builds it (untimed) and each unload parks
    it. `make(lot)` is a new engine using the lot; ready includes the KV sizing a node does
    right after a load (a vLLM worker's cache is re-initialised to the asked size)."""
    from mesh.engines.engine_api import EngineRequest, Sampling

    async def load(engine: Any) -> None:
        await engine.load()
        await engine.resize_kv(KV_BYTES)

    lot = ParkingLot(1 << 40)
    out = []
    try:
        engine = make(lot)
        await load(engine)
        ids = engine.encode_chat(QUESTION)
        await engine.unload()
        for _ in range(runs):
            engine = make(lot)
            t0 = time.perf_counter()
            await load(engine)
            t1 = time.perf_counter()
            engine.add_request(EngineRequest("q", len(ids), Sampling(max_tokens=1, temperature=0), ids))
            while engine.has_work():
                await engine.step()
            out.append({"ready": t1 - t0, "first_token": time.perf_counter() - t1, "loaded_from": engine.loaded_from})
            await engine.unload()
    finally:
        await lot.close()
    return out


def _openvino(model: Path, root: Path) -> Callable[[ParkingLot], Any]:
    from mesh.engines.openvino_process import OpenVINOProcessEngine

    return lambda lot: OpenVINOProcessEngine(model, context_window=2048, max_num_seqs=16, cache_root=root,
                                             log_dir=root / "logs", parking=lot)


def _vllm(folder: Path) -> Callable[[ParkingLot], Any]:
    from mesh.engines.vllm_engine import VLLMEngine

    def make(lot: ParkingLot) -> Any:
        engine = VLLMEngine(folder, context_window=2048, max_num_seqs=16)
        engine.parking = lot
        return engine
    return make


VLLM_STAGES = ("start_import", "build", "ready", "first_token")


async def _vllm_runs(folder: Path, runs: int) -> list[dict[str, Any]]:
    """vLLM loads, each in a fresh worker: `load()` without a KV size only starts the worker
    and imports vLLM; the KV resize then builds the engine (mesh.engines.vllm_engine)."""
    from mesh.engines.engine_api import EngineRequest, Sampling
    from mesh.engines.vllm_engine import VLLMEngine

    out = []
    for _ in range(runs):
        engine = VLLMEngine(folder, context_window=2048, max_num_seqs=16)
        kv = max(KV_BYTES, engine.min_kv_bytes())
        try:
            t0 = time.perf_counter()
            await engine.load()
            t1 = time.perf_counter()
            await engine.resize_kv(kv)
            t2 = time.perf_counter()
            ids = engine.encode_chat(QUESTION)
            t3 = time.perf_counter()
            engine.add_request(EngineRequest("q", len(ids), Sampling(max_tokens=1, temperature=0), ids))
            while engine.has_work():
                await engine.step()
            out.append({"start_import": t1 - t0, "build": t2 - t1, "ready": t2 - t0,
                        "first_token": time.perf_counter() - t3, "device": engine.device})
        finally:
            await engine.unload()
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _print(fig: dict[str, Any]) -> None:
    import openvino
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mesh bench coldstart: {Path(fig['model']).name}, {fig['runs']} fresh processes per "
                        f"source, median (min-max) seconds; OpenVINO {openvino.get_version().split('-')[0]}, "
                        f"{os.cpu_count()} cores")
    table.add_column("source")
    for stage in STAGES:
        table.add_column(stage.replace("_", " "), justify="right")
    table.add_column("blob")
    for source, row in fig["sources"].items():
        cells = [f"{row['stages'][s]['median']:.2f} ({row['stages'][s]['min']:.2f}-{row['stages'][s]['max']:.2f})"
                 if s in row["stages"] else "-" for s in STAGES]
        table.add_row(source, *cells, ", ".join(row.get("blob", ["-"])))
    Console(width=220).print(table)
    if "vllm" in fig:
        v = fig["vllm"]
        vt = Table(title=f"vLLM ({v['runs'][0]['device']}), {Path(v['folder']).name}: a fresh worker per run, "
                         "median (min-max) seconds")
        for stage in ("source", *VLLM_STAGES):
            vt.add_column(stage.replace("_", " + " if stage == "start_import" else " "), justify="right")
        for name, stages in (("hf folder", v["stages"]), ("parked", v["parked"]["stages"])):
            vt.add_row(name, *[f"{stages[s]['median']:.2f} ({stages[s]['min']:.2f}-{stages[s]['max']:.2f})"
                               if s in stages else "-" for s in VLLM_STAGES])
        Console(width=220).print(vt)
    print(f"prepare (GGUF -> IR + tokenizer IR, once per node, in the background): {fig['prepare_s']:.2f} s")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coldstart", help="an OpenVINO instance's cold start, stage by stage, per source")
    p.add_argument("--model", help="a GGUF file (default: the demo model, which must be fetched already)")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per source (default 5)")
    p.add_argument("--json", metavar="PATH", help="write every run's stages as JSON")
    p.add_argument("--vllm-hf", metavar="FOLDER", help="also time vLLM's cold start on this Hugging Face folder "
                   "(this machine's vLLM build; e.g. the demo GGUF converted with python -m mesh.modelfiles.convert)")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary folder)")

    def go(a: argparse.Namespace) -> int:
        if a.model:
            model = Path(a.model)
        else:
            from mesh.modelfiles.demo import ModelFetchError, demo_gguf_path

            try:
                model = demo_gguf_path(fetch=False)  # no fetch: nothing downloads at run time
            except ModelFetchError as exc:
                print(exc)
                return 2
        work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="mesh-coldstart-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            fig = run(model, a.runs, work, Path(a.vllm_hf) if a.vllm_hf else None)
        finally:
            if not a.keep:
                shutil.rmtree(work, ignore_errors=True)
        _print(fig)
        if a.json:
            write_json(a.json, fig)
        return 0

    p.set_defaults(func=go)


def main(argv: list[str] | None = None) -> int:
    """The child side: one load (`--child SOURCE`) or one preparation (`--child-prepare`)."""
    p = argparse.ArgumentParser(prog="python -m mesh.bench.coldstart")
    p.add_argument("--child", choices=SOURCES)
    p.add_argument("--child-prepare", action="store_true")
    p.add_argument("--model", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--blob-dir")
    p.add_argument("--spawned-at", type=float, default=time.time())
    args = p.parse_args(argv)
    from mesh.lifetime import die_with_parent

    die_with_parent()  # never outlive the bench
    result = _prepare_child(args) if args.child_prepare else _child(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
