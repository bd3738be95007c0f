"""GPU probe: host->device copy, Llama-2-7B-shaped decode/prefill step times, GEMM and copy rates.

The reference the GPU roofline is fitted to (mesh.perf.gpu_reference, docs/roofline.md "GPU
reference"). Random bf16 weights (no checkpoint). Writes one JSON (partial after every
section), the format of mesh/perf/gpu_reference/*.json:

    mesh calibrate --gpu-reference --out gpu-probe.json      (checks for PyTorch and a GPU first)
    python3 -m mesh.calibration.gpu_probe --out gpu-probe.json   (the same, on a machine with a GPU)

Self-contained on purpose (PyTorch and the standard library only): it runs on a lent GPU
machine that has PyTorch but neither Mesh's dependencies nor vLLM, as the file alone.
Its decoder's shape is Llama-2-7B's (mesh.perf.roofline.ARCHITECTURES; the fit checks the
"config" it writes). Brought in from the project's shared tools (../shared/tools/gpu_probe.py).

--tiny (or PROBE_TINY=1) runs a tiny config (2 layers, hidden 256) that also works on the
CPU, to check the probe itself; without it, a machine with no CUDA GPU is refused (exit 2).
--deadline (PROBE_DEADLINE_S, default 300) bounds the run: sections and configs past it
are skipped and listed under "skipped".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

T0 = time.perf_counter()
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEV.type == "cuda"
DT = torch.bfloat16
GB = 1e9


def configure(tiny: bool, deadline: float) -> None:
    """The sizes and grids of a full (Llama-2-7B-shaped) or a tiny run."""
    global TINY, DEADLINE, CFG, H2D_BYTES, CHUNK, D2D_BYTES, DECODE, EAGER, DECODE_VARIANTS, PREFILL
    global GEMM_B, GEMM_K, GEMM_N, REPS, PREFILL_REPS, RESULT
    TINY, DEADLINE = tiny, deadline
    if TINY:
        CFG = dict(layers=2, hidden=256, inter=688, heads=2, kv_heads=2, head_dim=128, vocab=1000)
        H2D_BYTES, CHUNK, D2D_BYTES = 64 * 2**20, 16 * 2**20, 64 * 2**20
        DECODE = [(1, 64), (4, 64), (2, 256)]
        EAGER = [(1, 64), (4, 64)]
        DECODE_VARIANTS = [(1, 64, "math")]
        PREFILL = [16, 64]
        GEMM_B, GEMM_K, GEMM_N = [1, 16, 64], 256, 688
        REPS, PREFILL_REPS = 5, 3
    else:
        CFG = dict(layers=32, hidden=4096, inter=11008, heads=32, kv_heads=32, head_dim=128, vocab=32000)
        H2D_BYTES, CHUNK, D2D_BYTES = int(13.5e9), 512 * 2**20, int(4e9)
        # most important first, so a deadline cuts the least useful
        DECODE = [(1, 512), (16, 512), (64, 512), (1, 2048), (16, 2048), (64, 2048), (4, 512), (256, 512)]
        EAGER = [(1, 512), (64, 512)]
        DECODE_VARIANTS = [(1, 512, "flash"), (64, 2048, "flash"), (256, 512, "flash")]
        PREFILL = [128, 512, 1024, 2048]
        GEMM_B, GEMM_K, GEMM_N = [1, 16, 256, 2048, 8192], 4096, 11008
        REPS, PREFILL_REPS = 30, 5
    RESULT = {"tiny": TINY, "device_type": DEV.type, "torch": torch.__version__, "config": CFG,
              "errors": [], "skipped": [], "created_by": "python -m mesh.calibration.gpu_probe",
              "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


configure(os.environ.get("PROBE_TINY") == "1", float(os.environ.get("PROBE_DEADLINE_S", "300")))
OUT_PATH = "gpu_probe.json"


def elapsed() -> float:
    return time.perf_counter() - T0


def save() -> None:
    RESULT["elapsed_s"] = round(elapsed(), 2)
    tmp = OUT_PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump(RESULT, f, indent=1)
    os.replace(tmp, OUT_PATH)


def log(msg: str) -> None:
    print(f"[{elapsed():7.1f}s] {msg}", flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def time_fn(fn, reps: int, warmup: int = 2) -> dict:
    """Median and spread of fn() over reps; CUDA events on the GPU, host clock on the CPU."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    w0 = time.perf_counter()
    if CUDA:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in evs:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in evs]
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    wall = (time.perf_counter() - w0) / reps
    times.sort()
    return {"median_s": statistics.median(times), "min_s": times[0], "max_s": times[-1],
            "p10_s": times[len(times) // 10], "p90_s": times[(9 * len(times)) // 10],
            "wall_mean_s": wall, "reps": reps}


def graph_time(fn, inner: int, reps: int, warmup: int = 3) -> dict:
    """Per-call time of fn, with `inner` calls captured in one CUDA graph (no launch overhead).
    On the CPU: plain time_fn of one call."""
    if not CUDA:
        t = time_fn(fn, reps, warmup=1)
        t["note"] = "cpu: eager"
        return t
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for _ in range(inner):
                fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    torch.cuda.synchronize()
    t = time_fn(g.replay, reps, warmup=warmup)
    del g
    for k in ("median_s", "min_s", "max_s", "p10_s", "p90_s", "wall_mean_s"):
        t[k] /= inner
    t["inner"] = inner
    return t


def guard(name: str, need_s: float = 0.0) -> bool:
    if elapsed() + need_s > DEADLINE:
        RESULT["skipped"].append(f"{name} (deadline at {elapsed():.0f}s)")
        log(f"SKIP {name}: deadline")
        return False
    return True


def record_error(name: str, exc: BaseException) -> None:
    msg = f"{name}: {type(exc).__name__}: {str(exc)[:400]}"
    RESULT["errors"].append(msg)
    log("ERROR " + msg)


# ---------------------------------------------------------------- 1. device info

def section_info() -> None:
    info: dict = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,driver_version",
                            "--format=csv"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    except Exception as exc:  # no nvidia-smi on the CPU box
        info["nvidia_smi"] = f"unavailable: {exc}"
    t = time.perf_counter()
    if CUDA:
        torch.cuda.init()
        torch.zeros(1, device=DEV)
        torch.cuda.synchronize()
    info["cuda_context_init_s"] = time.perf_counter() - t
    if CUDA:
        p = torch.cuda.get_device_properties(0)
        props = {}
        for k in ("name", "total_memory", "multi_processor_count", "major", "minor", "L2_cache_size",
                  "max_threads_per_multi_processor", "regs_per_multiprocessor", "uuid"):
            v = getattr(p, k, None)
            if v is not None:
                props[k] = v if isinstance(v, (int, float, str)) else str(v)
        info["torch_props"] = props
        info["torch_cuda"] = torch.version.cuda
        info["mem_get_info"] = list(torch.cuda.mem_get_info())
    RESULT["info"] = info
    log(f"info: {info.get('nvidia_smi')!r} ctx {info['cuda_context_init_s']:.2f}s")


# ---------------------------------------------------------------- 2. host -> device

def _h2d_copy(dst: torch.Tensor, src: torch.Tensor, chunk: int | None) -> float:
    sync()
    t = time.perf_counter()
    if chunk is None:
        dst.copy_(src, non_blocking=True)
    else:
        n = src.numel()
        for off in range(0, n, chunk):
            dst[off:off + chunk].copy_(src[off:off + chunk], non_blocking=True)
    sync()
    return time.perf_counter() - t


def _h2d_pinned(r: dict, dst: torch.Tensor) -> None:
    t = time.perf_counter()
    src = torch.empty(H2D_BYTES, dtype=torch.uint8, pin_memory=True)
    r["pinned_host_alloc_s"] = time.perf_counter() - t
    t = time.perf_counter()
    src.fill_(7)
    r["host_fill_s"] = time.perf_counter() - t
    runs = [_h2d_copy(dst, src, CHUNK) for _ in range(3)]
    r["pinned_chunked_s"] = runs
    r["pinned_chunked_first_GBps"] = H2D_BYTES / runs[0] / GB
    r["pinned_chunked_best_GBps"] = H2D_BYTES / min(runs) / GB
    runs = [_h2d_copy(dst, src, None) for _ in range(2)]
    r["pinned_whole_s"] = runs
    r["pinned_whole_best_GBps"] = H2D_BYTES / min(runs) / GB
    ok = bool((dst[-CHUNK:] == 7).all().item())
    r["pinned_check_ok"] = ok
    del src
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give the pinned block back before the pageable one
    log(f"h2d pinned: first {r['pinned_chunked_first_GBps']:.1f} GB/s, best {r['pinned_chunked_best_GBps']:.1f}"
        f" GB/s; alloc {r['pinned_host_alloc_s']:.2f}s")


def section_h2d() -> None:
    r: dict = {"bytes": H2D_BYTES, "chunk_bytes": CHUNK}
    RESULT["h2d"] = r
    t = time.perf_counter()
    dst = torch.empty(H2D_BYTES, dtype=torch.uint8, device=DEV)
    sync()
    r["gpu_alloc_cold_s"] = time.perf_counter() - t
    dst.fill_(0)  # touch
    sync()
    # (a) pinned, 512 MiB chunks
    try:
        if CUDA:
            _h2d_pinned(r, dst)
        else:
            r["pinned"] = "skipped on cpu"
    except Exception as exc:
        record_error("h2d pinned", exc)
    save()
    # (b) pageable
    t = time.perf_counter()
    src = torch.empty(H2D_BYTES, dtype=torch.uint8)
    src.fill_(9)
    r["pageable_host_alloc_fill_s"] = time.perf_counter() - t
    runs = [_h2d_copy(dst, src, None) for _ in range(2)]
    r["pageable_whole_s"] = runs
    r["pageable_whole_first_GBps"] = H2D_BYTES / runs[0] / GB
    r["pageable_whole_best_GBps"] = H2D_BYTES / min(runs) / GB
    runs = [_h2d_copy(dst, src, CHUNK) for _ in range(2)]
    r["pageable_chunked_s"] = runs
    r["pageable_chunked_best_GBps"] = H2D_BYTES / min(runs) / GB
    r["pageable_check_ok"] = bool((dst[:CHUNK] == 9).all().item())
    del src, dst
    if CUDA:
        torch.cuda.empty_cache()
    log(f"h2d pageable: first {r['pageable_whole_first_GBps']:.1f} GB/s, best {r['pageable_whole_best_GBps']:.1f} GB/s")


# ---------------------------------------------------------------- micro-benchmarks

def section_micro() -> None:
    r: dict = {"gemm": [], "shape": f"[B,{GEMM_K}]x[{GEMM_K},{GEMM_N}] bf16"}
    RESULT["micro"] = r
    nw = 4  # rotate weights so a 90 MB weight is not served from L2
    ws = [torch.randn(GEMM_N, GEMM_K, dtype=DT, device=DEV) * 0.02 for _ in range(nw)]
    for b in GEMM_B:
        if not guard(f"gemm B={b}"):
            break
        x = torch.randn(b, GEMM_K, dtype=DT, device=DEV)
        i = [0]

        def fn():
            i[0] = (i[0] + 1) % nw
            return x @ ws[i[0]].t()  # noqa: F821 - bound until the `del` below, after its last call
        ref = x.float() @ ws[0].float().t()
        err = ((x @ ws[0].t()).float() - ref).norm() / ref.norm()
        flops = 2.0 * b * GEMM_K * GEMM_N
        te = time_fn(fn, REPS, warmup=3)
        t = graph_time(fn, 16, REPS, warmup=3)
        t["B"] = b
        t["TFLOPs"] = flops / t["median_s"] / 1e12
        t["weight_GBps"] = GEMM_K * GEMM_N * 2 / t["median_s"] / GB
        t["eager_median_s"] = te["median_s"]
        t["eager_TFLOPs"] = flops / te["median_s"] / 1e12
        t["rel_err"] = float(err)
        r["gemm"].append(t)
        log(f"gemm B={b}: graph {t['median_s'] * 1e6:.1f} us {t['TFLOPs']:.1f} TFLOP/s {t['weight_GBps']:.0f} GB/s;"
            f" eager {te['median_s'] * 1e6:.1f} us; rel_err {err:.1e}")
    del ws
    save()
    n = D2D_BYTES // 2
    a = torch.randn(n, dtype=DT, device=DEV)
    b_ = torch.empty_like(a)
    t = time_fn(lambda: b_.copy_(a), 10, warmup=2)  # noqa: F821 - bound until the `del` below, after its last call
    t["bytes_copied"] = D2D_BYTES
    t["GBps_copied"] = D2D_BYTES / t["median_s"] / GB
    t["GBps_read_plus_write"] = 2 * D2D_BYTES / t["median_s"] / GB
    t["check_ok"] = bool(torch.equal(a[-1000:], b_[-1000:]))
    r["d2d"] = t
    del a, b_
    if CUDA:
        torch.cuda.empty_cache()
    log(f"d2d {D2D_BYTES / GB:.1f} GB: {t['median_s'] * 1e3:.2f} ms, {t['GBps_copied']:.0f} GB/s copied,"
        f" {t['GBps_read_plus_write']:.0f} GB/s r+w")


# ---------------------------------------------------------------- 3. the model

class Model:
    def __init__(self, c: dict):
        self.c = c
        h, i, hd = c["hidden"], c["inter"], c["head_dim"]
        nq, nkv, v = c["heads"], c["kv_heads"], c["vocab"]

        def rnd(*shape):
            return (torch.randn(*shape, dtype=DT, device=DEV) * 0.02)
        self.embed = rnd(v, h)
        self.lm_head = rnd(v, h)
        self.final_norm = torch.ones(h, dtype=DT, device=DEV)
        self.layers = []
        for _ in range(c["layers"]):
            self.layers.append(dict(
                n1=torch.ones(h, dtype=DT, device=DEV), n2=torch.ones(h, dtype=DT, device=DEV),
                wqkv=rnd((nq + 2 * nkv) * hd, h), wo=rnd(h, nq * hd),
                wgu=rnd(2 * i, h), wd=rnd(h, i)))
        # stand-in for rotary: one elementwise multiply of q and k
        self.rot = (1.0 + 0.01 * torch.randn(hd, device=DEV)).to(DT)
        self.params = sum(t.numel() for t in [self.embed, self.lm_head, self.final_norm]) + sum(
            t.numel() for layer in self.layers for t in layer.values())

    @staticmethod
    def rms(x, w, eps=1e-5):
        if hasattr(F, "rms_norm"):  # one fused kernel on recent CUDA builds
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(DT) * w

    def forward(self, tokens, caches, pos: int, last_only: bool = True):
        """tokens [B, T]; caches: per layer (K, V) [B, nkv, L_max, hd]; writes K/V at pos..pos+T.
        T == 1: decode against cache[:pos+1]; T > 1: causal prefill (pos must be 0)."""
        c = self.c
        nq, nkv, hd = c["heads"], c["kv_heads"], c["head_dim"]
        B, T = tokens.shape
        x = F.embedding(tokens, self.embed)  # [B, T, h]
        for layer, (kc, vc) in zip(self.layers, caches):
            hN = self.rms(x, layer["n1"])
            qkv = hN @ layer["wqkv"].t()
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q = (q.view(B, T, nq, hd) * self.rot).transpose(1, 2)
            k = (k.view(B, T, nkv, hd) * self.rot).transpose(1, 2)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            kc[:, :, pos:pos + T].copy_(k)
            vc[:, :, pos:pos + T].copy_(v)
            if T == 1:
                a = F.scaled_dot_product_attention(q, kc[:, :, :pos + 1], vc[:, :, :pos + 1])
            else:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(B, T, nq * hd) @ layer["wo"].t()
            hN = self.rms(x, layer["n2"])
            g, u = (hN @ layer["wgu"].t()).chunk(2, dim=-1)
            x = x + (F.silu(g) * u) @ layer["wd"].t()
        if last_only:
            x = x[:, -1]
        logits = self.rms(x, self.final_norm) @ self.lm_head.t()
        return logits.argmax(-1)


def alloc_cache(m: Model, b: int, lmax: int):
    c = m.c
    caches = []
    for _ in range(c["layers"]):
        k = torch.empty(b, c["kv_heads"], lmax, c["head_dim"], dtype=DT, device=DEV).normal_()
        v = torch.empty(b, c["kv_heads"], lmax, c["head_dim"], dtype=DT, device=DEV).normal_()
        caches.append((k, v))
    return caches


def cache_bytes(m: Model, b: int, lmax: int) -> int:
    c = m.c
    return 2 * c["layers"] * b * c["kv_heads"] * lmax * c["head_dim"] * 2


def free_mem() -> int:
    if CUDA:
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    return 8 * 2**30


def section_model() -> Model:
    t = time.perf_counter()
    m = Model(CFG)
    sync()
    RESULT["model"] = {"params": m.params, "weight_bytes": m.params * 2, "init_s": time.perf_counter() - t}
    log(f"model: {m.params / 1e9:.3f} B params, init {RESULT['model']['init_s']:.2f}s")
    return m


def section_prefill(m: Model) -> None:
    out = []
    RESULT["prefill"] = out
    for L in PREFILL:
        if not guard(f"prefill L={L}", 5):
            break
        try:
            caches = alloc_cache(m, 1, L)
            tok = torch.randint(0, CFG["vocab"], (1, L), device=DEV)
            with torch.no_grad():
                t = time_fn(lambda: m.forward(tok, caches, 0), PREFILL_REPS, warmup=2)  # noqa: F821 - bound until the `del` below, after its last call
            t["L"] = L
            out.append(t)
            msg = f"prefill L={L}: eager {t['median_s'] * 1e3:.2f} ms"
            if CUDA:
                try:
                    with torch.no_grad():
                        t["graph"] = graph_time(lambda: m.forward(tok, caches, 0),  # noqa: F821 - as above
                                                1, PREFILL_REPS * 2)
                    msg += f", graph {t['graph']['median_s'] * 1e3:.2f} ms"
                except Exception as exc:
                    record_error(f"prefill graph L={L}", exc)
            log(msg)
            del caches
        except Exception as exc:
            record_error(f"prefill L={L}", exc)
        save()


def _decode_one(m: Model, b: int, ctx: int, eager: bool, backend: str | None = None) -> dict:
    if backend:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
        with sdpa_kernel([be]):
            res = _decode_one(m, b, ctx, eager, None)
        res["sdpa_backend"] = backend
        return res
    res: dict = {"B": b, "context": ctx}
    need = cache_bytes(m, b, ctx + 1)
    res["kv_bytes"] = need
    if need + 3 * 2**30 > free_mem():
        res["skipped"] = f"KV cache {need / GB:.1f} GB does not fit"
        log(f"decode B={b} ctx={ctx}: skipped, no memory")
        return res
    caches = alloc_cache(m, b, ctx + 1)
    tok = torch.randint(0, CFG["vocab"], (b, 1), device=DEV)
    with torch.no_grad():
        def step():
            return m.forward(tok, caches, ctx)  # noqa: F821 - bound until the `del` below, after its last call

        if CUDA:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static_out = step()
                torch.cuda.synchronize()
            except Exception as exc:  # retry with flash/efficient attention only
                RESULT["errors"].append(f"capture B={b} ctx={ctx} default sdpa: {str(exc)[:300]}")
                from torch.nn.attention import SDPBackend, sdpa_kernel
                res["sdpa_restricted"] = True
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                    with torch.cuda.graph(g):
                        static_out = step()
                torch.cuda.synchronize()
            res["capture_s"] = time.perf_counter() - t
            res["graph"] = time_fn(g.replay, REPS, warmup=5)
            res["graph_out_ok"] = bool(((static_out >= 0) & (static_out < CFG["vocab"])).all().item())
            del g, static_out
        else:
            res["graph"] = time_fn(step, REPS, warmup=2)  # CPU: no graphs, eager stands in
            res["graph_note"] = "cpu: eager"
        if eager:
            res["eager"] = time_fn(step, REPS, warmup=3)
    del caches
    msg = f"decode B={b} ctx={ctx}: graph {res['graph']['median_s'] * 1e3:.3f} ms"
    if eager:
        msg += f", eager {res['eager']['median_s'] * 1e3:.3f} ms (wall {res['eager']['wall_mean_s'] * 1e3:.3f})"
    log(msg)
    return res


def section_decode(m: Model) -> None:
    out = []
    RESULT["decode"] = out
    for b, ctx in DECODE:
        if not guard(f"decode B={b} ctx={ctx}", 10):
            continue
        try:
            out.append(_decode_one(m, b, ctx, eager=(b, ctx) in EAGER))
        except Exception as exc:
            record_error(f"decode B={b} ctx={ctx}", exc)
        free_mem()
        save()
    for b, ctx, backend in DECODE_VARIANTS:
        if not guard(f"decode B={b} ctx={ctx} sdpa={backend}", 10):
            continue
        try:
            r = _decode_one(m, b, ctx, eager=False, backend=backend)
            out.append(r)
            log(f"  (sdpa backend {backend})")
        except Exception as exc:
            record_error(f"decode B={b} ctx={ctx} sdpa={backend}", exc)
        free_mem()
        save()


def section_profile(m: Model) -> None:
    """Top GPU kernels of one eager decode step (B=16), to see which attention/GEMM kernels ran."""
    b, ctx = (16, 512) if not TINY else (2, 64)
    caches = alloc_cache(m, b, ctx + 1)
    tok = torch.randint(0, CFG["vocab"], (b, 1), device=DEV)
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with torch.no_grad():
        for _ in range(2):
            m.forward(tok, caches, ctx)
        sync()
        with profile(activities=acts) as prof:
            m.forward(tok, caches, ctx)
            sync()
    rows = []
    evs = list(prof.key_averages())
    if CUDA:
        kern = [ev for ev in evs if "CUDA" in str(getattr(ev, "device_type", ""))]
        evs = kern or evs
    for ev in evs:
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
        if CUDA and dt <= 0:
            continue
        rows.append((dt if CUDA else ev.cpu_time_total, ev.key[:120], ev.count))
    rows.sort(reverse=True)
    RESULT["profile_decode"] = {"B": b, "context": ctx, "top_kernels_us": [
        {"us": round(r[0], 1), "name": r[1], "count": r[2]} for r in rows[:15]]}
    del caches
    for r in rows[:6]:
        log(f"  prof {r[0]:9.1f} us x{r[2]:4d} {r[1][:90]}")


def smi_after() -> None:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,"
                            "clocks_throttle_reasons.active", "--format=csv"],
                           capture_output=True, text=True, timeout=30)
        RESULT["nvidia_smi_after"] = q.stdout.strip() or q.stderr.strip()
    except Exception as exc:
        RESULT["nvidia_smi_after"] = f"unavailable: {exc}"


def main(argv: list[str] | None = None) -> int:
    global OUT_PATH
    ap = argparse.ArgumentParser(prog="python -m mesh.calibration.gpu_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_probe.json", help="JSON to write (default: %(default)s)")
    ap.add_argument("--tiny", action="store_true", default=TINY, help="the tiny config (also on the CPU)")
    ap.add_argument("--deadline", type=float, default=DEADLINE, help="seconds the run may take (default: %(default)s)")
    args = ap.parse_args(argv)
    configure(args.tiny, args.deadline)
    if not CUDA and not TINY:
        print(f"gpu_probe: no CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False). "
              "The probe measures a GPU: run it where one is, or pass --tiny to check the probe on the CPU.",
              file=sys.stderr)
        return 2
    OUT_PATH = args.out
    log(f"device {DEV}, tiny={TINY}, deadline {DEADLINE}s")
    for name, fn in (("info", section_info), ("h2d", section_h2d), ("micro", section_micro)):
        if not guard(name):
            continue
        try:
            fn()
        except Exception as exc:
            record_error(name, exc)
        save()
    try:
        m = section_model()
    except Exception as exc:
        record_error("model", exc)
        save()
        return 1
    save()
    section_prefill(m)
    section_decode(m)
    if guard("profile", 10):
        try:
            section_profile(m)
        except Exception as exc:
            record_error("profile", exc)
    smi_after()
    if CUDA:
        RESULT["sdpa_flags"] = {k: getattr(torch.backends.cuda, k)() for k in (
            "flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled")
            if hasattr(torch.backends.cuda, k)}
    save()
    # summary
    print("\n==== summary ====")
    h = RESULT.get("h2d", {})
    for k in ("gpu_alloc_cold_s", "pinned_host_alloc_s", "pinned_chunked_s", "pinned_chunked_best_GBps",
              "pageable_whole_s", "pageable_whole_best_GBps", "pageable_chunked_best_GBps"):
        if k in h:
            print(f"h2d {k}: {h[k]}")
    for g in RESULT.get("micro", {}).get("gemm", []):
        print(f"gemm B={g['B']}: {g['TFLOPs']:.1f} TFLOP/s ({g['median_s'] * 1e6:.1f} us graph,"
              f" {g['eager_median_s'] * 1e6:.1f} us eager)")
    d = RESULT.get("micro", {}).get("d2d")
    if d:
        print(f"d2d: {d['GBps_copied']:.0f} GB/s copied ({d['GBps_read_plus_write']:.0f} r+w)")
    for p in RESULT.get("prefill", []):
        gr = f", graph {p['graph']['median_s'] * 1e3:.2f} ms" if "graph" in p else ""
        print(f"prefill L={p['L']}: eager {p['median_s'] * 1e3:.2f} ms{gr}")
    for r in RESULT.get("decode", []):
        if "graph" in r:
            e = f" eager {r['eager']['median_s'] * 1e3:.3f}" if "eager" in r else ""
            v = f" [sdpa {r['sdpa_backend']}]" if "sdpa_backend" in r else ""
            print(f"decode B={r['B']} ctx={r['context']}{v}: graph {r['graph']['median_s'] * 1e3:.3f} ms{e}")
        else:
            print(f"decode B={r['B']} ctx={r['context']}: {r.get('skipped')}")
    print("errors:", RESULT["errors"], "skipped:", RESULT["skipped"])
    print(f"total {elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
