"""Reference profiles from a roofline model (docs/roofline.md explains every number).

One iteration costs

    time = max(compute, memory) + device_overhead + engine_overhead
    compute = weight-matmul FLOPs / (peak * eff_gemm) + attention FLOPs / (peak * eff_attn)
    memory  = (weight bytes + KV bytes read) / (bandwidth * eff_bw)
              ... with KV bytes read at bandwidth * eff_kv, KV bytes written at eff_bw

Peaks are datasheet numbers. The efficiency factors (fractions of peak reached) and the
device's per-iteration overhead of the h200 and h100 entries are fitted to probes of those
GPUs (mesh.perf.gpu_reference); the A100 takes their mean; the CPU's are fitted to what
LLM-Mesh 3.1 states about the CPU (tests/test_roofline.py holds the packaged profiles to
those statements). Each GPU step adds vLLM's own per-step time (VLLM_STEP_OVERHEAD_S).
Grids follow LLM-Mesh 5.2: powers of two, prompt lengths 16..max_context, batch sizes
1..256, context lengths 16..max_context.

Run `python -m mesh.perf.roofline` to regenerate mesh/perf/profiles/*.json.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, Sequence

from mesh.perf.load_times import GIB, PCIE_BYTES_PER_S
from mesh.perf.profile import Profile, profile_from_dict, save_profile

DTYPE, DTYPE_BYTES = "bf16", 2  # 16-bit weights and KV cache (LLM-Mesh 3.1, 8.1)
BATCH_SIZES = tuple(2**k for k in range(0, 9))  # 1..256 (LLM-Mesh 5.2, B_max = 256)
MIN_LENGTH = 16
SIGNIFICANT_DIGITS = 6  # times are rounded so the JSON is short and regenerates exactly


# --- model arithmetic: the one home of a Llama-style model's sizes ------------------------------
# (mesh.modelfiles.local counts a checkpoint's parameters with llama_params, the OpenVINO engine
# sizes its KV cache with kv_bytes_per_token.)

def llama_layer_matmul_params(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Matmul weights of one decoder layer: Q and O, K and V (GQA), the SwiGLU MLP."""
    q_o = 2 * hidden * heads * head_dim
    k_v = 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * intermediate  # gate, up, down
    return q_o + k_v + mlp


def llama_params(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 tied_embeddings: bool) -> int:
    """All parameters: layers with their two RMSNorms, embedding, final norm, LM head
    (none of its own with tied embeddings)."""
    norms = (2 * layers + 1) * hidden
    embeddings = vocab * hidden * (1 if tied_embeddings else 2)
    return layers * llama_layer_matmul_params(hidden, intermediate, heads, kv_heads, head_dim) + norms + embeddings


class KVShape(Protocol):
    """What a model's KV cache size depends on (mesh.modelfiles.shape.ModelShape, Architecture)."""

    @property
    def layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


_FLOAT_SIZES = {"f32": 4, "f16": 2, "bf16": 2}


def kv_bytes_per_token(shape: KVShape, key_precision: str = "u8", value_precision: str = "u8",
                       block_size: int = 32) -> int:
    """KV bytes one token holds across all layers.

    Float caches hold 2 x layers x kv_heads x head_dim x element size. The u8 caches (the
    default of OpenVINO's CPU plugin) add quantization parameters, measured on OpenVINO
    2026.4: keys are quantized per channel with an f32 scale and zero point per channel per
    block, values per token with an f32 scale and zero point per token. Per head and token that
    is head_dim + 8*head_dim/block_size bytes of key and head_dim + 8 bytes of value.
    """
    per_head = _key_bytes(shape.head_dim, key_precision, block_size)
    per_head += _value_bytes(shape.head_dim, value_precision)
    return int(round(shape.layers * shape.kv_heads * per_head))


def _key_bytes(head_dim: int, precision: str, block_size: int) -> float:
    if precision in _FLOAT_SIZES:
        return head_dim * _FLOAT_SIZES[precision]
    if precision == "u8":
        return head_dim + 8 * head_dim / block_size
    raise ValueError(f"unsupported key cache precision {precision!r} (use u8, bf16, f16, f32)")


def _value_bytes(head_dim: int, precision: str) -> float:
    if precision in _FLOAT_SIZES:
        return head_dim * _FLOAT_SIZES[precision]
    if precision == "u8":
        return head_dim + 8
    raise ValueError(f"unsupported value cache precision {precision!r} (use u8, bf16, f16, f32)")


@dataclass(frozen=True)
class Architecture:
    """A decoder-only Llama-style transformer (RMSNorm, SwiGLU MLP, optional GQA)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    max_context: int
    tied_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_matmul_params(self) -> int:
        return llama_layer_matmul_params(self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim)

    @property
    def body_matmul_params(self) -> int:
        """Matmul weights every token passes through (all layers, not the LM head)."""
        return self.layers * self.layer_matmul_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (llama_params)."""
        return llama_params(self.layers, self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim,
                            self.vocab, self.tied_embeddings)

    @property
    def weight_bytes(self) -> int:
        return self.params * DTYPE_BYTES

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights read once per iteration: every matmul weight and norm. The input embedding
        table is only gathered (a few rows), so an untied table is not streamed."""
        untied_table = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.params - untied_table) * DTYPE_BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self, DTYPE, DTYPE)  # 16-bit K and V


@dataclass(frozen=True)
class Hardware:
    """A device: datasheet peaks and the fractions of them an engine reaches."""

    device: str
    kind: str  # "cpu" | "gpu"
    description: str
    engine: str  # the engine this profile stands in for
    peak_flop_per_s: float  # 16-bit dense matmul FLOP/s
    peak_bytes_per_s: float  # memory bandwidth, bytes/s
    eff_gemm: float  # fraction of peak_flop_per_s for weight matmuls
    eff_attn: float  # fraction of peak_flop_per_s for attention (QK^T, AV)
    eff_bw: float  # fraction of peak_bytes_per_s streaming weights
    eff_kv: float  # fraction of peak_bytes_per_s reading the paged KV cache
    device_overhead_s: float  # fixed per iteration on the device: the small kernels and gaps left out above
    engine_overhead_s: float  # fixed per iteration in the engine: scheduling, input preparation, sampling
    peak_note: str
    origin: str = ""  # where the factors come from (docs/roofline.md has each number's source)
    memory_bytes: int = 0  # device memory; 0: the replay's default for its kind (mesh.control.fleet)
    host_to_device_bytes_per_s: float | None = None  # pinned host memory -> device: a GPU cold start
    host_to_device_pageable_bytes_per_s: float | None = None  # the same from pageable host memory


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        # config.json of each model; max_context capped at 8192 where the model allows more.
        Architecture("llama-3.2-3b", 28, 3072, 8192, 24, 8, 128256, 8192, tied_embeddings=True),
        Architecture("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096, tied_embeddings=False),
        Architecture("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, 4096, tied_embeddings=False),
        Architecture("codestral-22b", 56, 6144, 16384, 48, 8, 32768, 8192, tied_embeddings=False),
    )
}

# vLLM's own work per step on the host (scheduling, input preparation, sampling, output
# processing), not overlapped with the GPU in Mesh's engine, which calls LLMEngine.step()
# once per iteration (docs/vllm.md). Assumed, from two sources (docs/roofline.md): vLLM's
# v0.6.0 performance post (blog.vllm.ai, 2024-09-05: on one H100 with Llama-3-8B, v0.5.3
# spent 29% of its time scheduling and preparing inputs against 38% on the GPU) and vLLM
# 0.32's step measured here on its CPU build (docs/vllm.md: 1.8-2.5 ms in-process for the
# tiny Llama, its forward pass included).
VLLM_STEP_OVERHEAD_S = 0.002
FITTED_GPUS = ("h200", "h100")  # entries whose GPU-side factors mesh.perf.gpu_reference fits

HARDWARE: dict[str, Hardware] = {
    "h200": Hardware(
        device="h200",
        kind="gpu",
        description="NVIDIA H200 SXM, 141 GB HBM3e",
        engine="vllm",
        peak_flop_per_s=989e12,
        peak_bytes_per_s=4.8e12,
        eff_gemm=0.583,
        eff_attn=0.35,
        eff_bw=0.752,
        eff_kv=0.882,
        device_overhead_s=0.00152,
        engine_overhead_s=VLLM_STEP_OVERHEAD_S,
        peak_note="datasheet: 989 TFLOPS bf16 dense tensor core, 4.8 TB/s HBM3e",
        origin="GPU side fitted to mesh/perf/gpu_reference/gpu-h200-probe.json (mesh.perf.gpu_reference)",
        memory_bytes=150_109_880_320,  # torch's total_memory in the probe
        host_to_device_bytes_per_s=55.3e9,
        host_to_device_pageable_bytes_per_s=6.97e9,
    ),
    "h100": Hardware(
        device="h100",
        kind="gpu",
        description="NVIDIA H100 80GB HBM3 (SXM5)",
        engine="vllm",
        peak_flop_per_s=989e12,
        peak_bytes_per_s=3.35e12,
        eff_gemm=0.573,
        eff_attn=0.457,
        eff_bw=0.766,
        eff_kv=0.929,
        device_overhead_s=0.00146,
        engine_overhead_s=VLLM_STEP_OVERHEAD_S,
        peak_note="datasheet: 989 TFLOPS bf16 dense tensor core, 3.35 TB/s HBM3",
        origin="GPU side fitted to mesh/perf/gpu_reference/gpu-h100-probe.json (mesh.perf.gpu_reference)",
        memory_bytes=85_017_493_504,  # torch's total_memory in the probe
        host_to_device_bytes_per_s=54.6e9,
        host_to_device_pageable_bytes_per_s=8.31e9,
    ),
    "a100-80gb": Hardware(
        device="a100-80gb",
        kind="gpu",
        description="NVIDIA A100-80GB SXM",
        engine="vllm",
        peak_flop_per_s=312e12,
        peak_bytes_per_s=2039e9,
        # the mean of the h200 and h100 fits: not measured on an A100 (docs/roofline.md)
        eff_gemm=0.578,
        eff_attn=0.403,
        eff_bw=0.759,
        eff_kv=0.905,
        device_overhead_s=0.00149,
        engine_overhead_s=VLLM_STEP_OVERHEAD_S,
        peak_note="datasheet: 312 TFLOPS bf16 dense tensor core, 2039 GB/s HBM2e",
        origin="GPU side: the mean of the h200 and h100 fits, assumed to carry over to the A100",
        memory_bytes=80 * GIB,
        host_to_device_bytes_per_s=PCIE_BYTES_PER_S,  # PCIe 4.0 x16 with pinned memory, assumed (mesh.perf.load_times)
    ),
    "xeon-6462c": Hardware(
        device="xeon-6462c",
        kind="cpu",
        description="Intel Xeon Gold 6462C, 32 cores @ 3.3 GHz, AMX, 8 x DDR5-4800",
        engine="openvino",
        peak_flop_per_s=32 * 3.3e9 * 1024,
        peak_bytes_per_s=8 * 4800e6 * 8,
        eff_gemm=0.25,
        eff_attn=0.03,
        eff_bw=0.65,
        eff_kv=0.59,
        device_overhead_s=0.0,
        engine_overhead_s=0.005,
        peak_note=(
            "32 cores x 3.3 GHz x 1024 bf16 FLOP/cycle/core (AMX TMUL, the commonly cited "
            "figure) = 108.1 TFLOPS; 8 channels x 4800 MT/s x 8 bytes = 307.2 GB/s"
        ),
        origin="fitted to the CPU statements of LLM-Mesh 3.1, not measured",
    ),
}

# (model, device) pairs with a reference profile: Codestral-22B only on the CPU, for the
# prefill check of LLM-Mesh 3.1.
REFERENCE_PAIRS: tuple[tuple[str, str], ...] = (
    ("llama-3.2-3b", "a100-80gb"),
    ("llama-3.2-3b", "xeon-6462c"),
    ("llama-2-7b", "a100-80gb"),
    ("llama-2-7b", "xeon-6462c"),
    ("llama-2-13b", "a100-80gb"),
    ("llama-2-13b", "xeon-6462c"),
    ("codestral-22b", "xeon-6462c"),
    ("llama-3.2-3b", "h200"),
    ("llama-2-7b", "h200"),
    ("llama-2-13b", "h200"),
    ("llama-3.2-3b", "h100"),
    ("llama-2-7b", "h100"),
    ("llama-2-13b", "h100"),
)


def host_to_device_bytes_per_s(device: str, default: float) -> float:
    """Host-to-GPU bandwidth of a GPU cold start on `device`, from pinned host memory (the
    paper's setup: ServerlessLLM's loader, LLM-Mesh 8.1): the HARDWARE entry's (measured on
    h200 and h100, assumed on the A100), else `default` for a device it does not know."""
    hw = HARDWARE.get(device)
    found = hw.host_to_device_bytes_per_s if hw is not None else None
    return found if found is not None else default


def _time(hw: Hardware, gemm_flops: float, attn_flops: float, weight_bytes: float,
          kv_read: float, kv_write: float, engine: bool) -> float:
    """Roofline: the slower of compute and memory traffic, plus the device's fixed overhead,
    plus the engine's when `engine` (False: the device's side alone, what a probe measures)."""
    flops = hw.peak_flop_per_s
    compute = gemm_flops / (flops * hw.eff_gemm) + attn_flops / (flops * hw.eff_attn)
    bw = hw.peak_bytes_per_s
    memory = (weight_bytes + kv_write) / (bw * hw.eff_bw) + kv_read / (bw * hw.eff_kv)
    return max(compute, memory) + hw.device_overhead_s + (hw.engine_overhead_s if engine else 0.0)


def prefill_seconds(arch: Architecture, hw: Hardware, prompt_len: int, engine: bool = True) -> float:
    """One prefill iteration of a single prompt of `prompt_len` tokens (`engine`: see _time)."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    # Every prompt token through every layer; logits only for the last token.
    gemm = 2.0 * (arch.body_matmul_params * prompt_len + arch.lm_head_params)
    # Causal attention: token i attends to i tokens; QK^T and AV, 2 FLOPs a multiply-add.
    attn = 4.0 * arch.layers * arch.heads * arch.head_dim * prompt_len * (prompt_len + 1) / 2
    kv_write = prompt_len * arch.kv_bytes_per_token
    return _time(hw, gemm, attn, arch.streamed_weight_bytes, 0.0, kv_write, engine)


def decode_seconds(arch: Architecture, hw: Hardware, batch: int, context: int, engine: bool = True) -> float:
    """One decode iteration: `batch` requests, each with `context` tokens in its KV cache."""
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be at least 1, got {batch}, {context}")
    gemm = 2.0 * (arch.body_matmul_params + arch.lm_head_params) * batch
    attn = 4.0 * arch.layers * arch.heads * arch.head_dim * context * batch
    kv_read = batch * context * arch.kv_bytes_per_token
    kv_write = batch * arch.kv_bytes_per_token
    return _time(hw, gemm, attn, arch.streamed_weight_bytes, kv_read, kv_write, engine)


def _round(seconds: float) -> float:
    return float(f"{seconds:.{SIGNIFICANT_DIGITS}g}")


def _lengths(max_context: int) -> list[int]:
    out, n = [], MIN_LENGTH
    while n <= max_context:
        out.append(n)
        n *= 2
    return out


def roofline_profile(arch: Architecture, hw: Hardware) -> Profile:
    """The roofline profile of `arch` on `hw`, on the LLM-Mesh 5.2 grids."""
    lengths = _lengths(arch.max_context)
    params = {k: v for k, v in asdict(hw).items() if k not in ("device", "kind", "engine")}
    data = {
        "format": "mesh-profile/1",
        "model": arch.name,
        "device": hw.device,
        "device_kind": hw.kind,
        "engine": "roofline",
        "kv_bytes_per_token": arch.kv_bytes_per_token,
        "weight_bytes": arch.weight_bytes,
        "max_context": arch.max_context,
        "prefill": {
            "prompt_lengths": lengths,
            "seconds": [_round(prefill_seconds(arch, hw, n)) for n in lengths],
        },
        "decode": {
            "batch_sizes": list(BATCH_SIZES),
            "context_lengths": lengths,
            "seconds": [[_round(decode_seconds(arch, hw, b, c)) for c in lengths] for b in BATCH_SIZES],
        },
        "provenance": {
            "method": "roofline",
            "hardware": params,
            "engine": {"name": "roofline", "version": "1", "stands_in_for": hw.engine},
            "architecture": asdict(arch),
            "created_by": "python -m mesh.perf.roofline",
            "notes": (
                "time = max(compute, memory) + device_overhead_s + engine_overhead_s per "
                f"iteration; factors: {hw.origin}; see docs/roofline.md. Grid points whose KV "
                "cache exceeds device memory are model values only."
            ),
        },
    }
    return profile_from_dict(data, source=f"<roofline {arch.name}/{hw.device}>")


def reference_profile_path(out_dir: str | Path, model: str, device: str) -> Path:
    return Path(out_dir) / f"{model}__{device}.json"


def write_reference_profiles(out_dir: str | Path) -> list[Path]:
    """Write every reference profile into `out_dir` (created if missing); return the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for model, device in REFERENCE_PAIRS:
        path = reference_profile_path(out, model, device)
        save_profile(roofline_profile(ARCHITECTURES[model], HARDWARE[device]), path)
        paths.append(path)
    return paths


TABLE_PREFILL = (512, 2048, 4096)
TABLE_BATCHES = (1, 16, 32, 64)
TABLE_CONTEXT = 1024


def markdown_table() -> str:
    """Times of the reference profiles (seconds), as in docs/roofline.md."""
    head = ["model", "device"] + [f"prefill {n}" for n in TABLE_PREFILL]
    head += [f"decode b={b}" for b in TABLE_BATCHES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, device in REFERENCE_PAIRS:
        arch, hw = ARCHITECTURES[model], HARDWARE[device]
        cells = [model, device]
        cells += [f"{prefill_seconds(arch, hw, n):.3f}" for n in TABLE_PREFILL]
        cells += [f"{decode_seconds(arch, hw, b, TABLE_CONTEXT):.4f}" for b in TABLE_BATCHES]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mesh.perf.roofline",
        description="Regenerate the roofline reference profiles (docs/roofline.md).",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "profiles"),
        help="output folder (default: the packaged mesh/perf/profiles)",
    )
    parser.add_argument("--table", action="store_true", help="print the docs/roofline.md table instead")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(), end="")
        return 0
    for path in write_reference_profiles(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
