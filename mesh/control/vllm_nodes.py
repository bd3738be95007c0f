"""vLLM node agents on this machine: one per GPU when vLLM's CUDA build is installed, and a
vLLM-on-CPU agent when asked (to test the GPU path on a machine without a GPU).

`vllm_node_specs()` adds to mesh.control.supervisor.detect_local_nodes: a NodeSpec of kind
"gpu" named `gpu-N` per CUDA device (memory: the device's total), and, with
`vllm_cpu=True` or MESH_VLLM_CPU_NODE=1, a node `vllm-cpu-0` of kind "gpu" whose vLLM
runs on the CPU (memory: MESH_VLLM_CPU_NODE_GB, default 4 GiB). `agent_env(spec)` is the
environment its agent process needs: CUDA_VISIBLE_DEVICES=N for `gpu-N` (each agent and
its vLLM workers see one GPU), MESH_VLLM_DEVICE=cpu for `vllm-cpu-0`. The agents register
the vLLM engine factory (mesh.node.engine_host: InstanceSpec.engine == "vllm"); the service
sends Hugging Face folders there with engine="vllm".
"""
from __future__ import annotations

import os
import shutil
import subprocess

from mesh.policy.node_spec import NodeSpec

CPU_NODE_ID = "vllm-cpu-0"
DEFAULT_CPU_NODE_GB = 4.0


def gpu_memory_bytes() -> list[int]:
    """Total memory of each GPU nvidia-smi lists, in device order ([] without GPUs)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    out = []
    for line in done.stdout.splitlines():
        try:
            out.append(int(float(line.strip())) * 2**20)  # MiB
        except ValueError:
            continue
    return out


def vllm_node_specs(vllm_cpu: bool | None = None) -> list[NodeSpec]:
    """GPU nodes when vLLM's CUDA build and GPUs are present; the vLLM-on-CPU node if asked."""
    from mesh.hardware import vllm_info

    if vllm_cpu is None:
        vllm_cpu = os.environ.get("MESH_VLLM_CPU_NODE") == "1"
    if not vllm_cpu and shutil.which("nvidia-smi") is None:
        return []  # no GPU and not asked: skip probing vLLM's environment
    info = vllm_info(other_pythons=True)
    specs = []
    if info.installed and info.device == "cuda":
        specs += [NodeSpec(f"gpu-{i}", "gpu", mem) for i, mem in enumerate(gpu_memory_bytes())]
    if vllm_cpu and info.installed:
        gb = float(os.environ.get("MESH_VLLM_CPU_NODE_GB") or DEFAULT_CPU_NODE_GB)
        specs.append(NodeSpec(CPU_NODE_ID, "gpu", int(gb * 2**30)))
    return specs


def agent_env(spec: NodeSpec) -> dict[str, str]:
    """Environment variables the agent of `spec` needs (empty for CPU nodes)."""
    if spec.node_id == CPU_NODE_ID:
        return {"MESH_VLLM_DEVICE": "cpu"}
    if spec.kind == "gpu" and spec.node_id.startswith("gpu-"):
        return {"CUDA_VISIBLE_DEVICES": spec.node_id.removeprefix("gpu-"), "MESH_VLLM_DEVICE": "cuda"}
    return {}
