"""Emulated nodes: real node agents whose instances are emulated engines (mesh.engines.emulated).

`mesh serve --emulate xeon-6462c:4,a100-80gb:4` (or `h200:1`, `h100:2`) starts one agent per node, each with
`python -m mesh.agent --emulate DEVICE`: the agent, its connection, its node runtime
(token-level loop, memory subsystem, shadow validation) and the service's dispatcher and
weights plane are the real ones; only the engines emulate. A node's kind and memory come
from its device as in the replay: the kind its profiles give (a Xeon a CPU node, an A100 a
GPU node), the memory the replay's cluster gives that kind (mesh.control.fleet.ClusterConfig:
256 GiB of a CPU node, 80 GiB of a GPU), except a GPU whose roofline entry gives its own
(mesh.perf.roofline.HARDWARE: an h200's 140 GiB). A GPU load copies the weights from pinned
host memory at the device's host-to-GPU bandwidth (`emulated_cold_start`).

An emulated model is a catalog name (`llama-2-7b`, ...): its instances take the sizes
(weights, KV bytes per token, context) and iteration times of `catalog_profile(name, device)`,
the lookup the replay's catalog makes (mesh.perf.profile), with the replay's noise. The
service names it as the instance's path and as its profile (`emulated:NAME`), which each
agent resolves on its own device. An agent started without `--emulate` refuses both.

A real model (a GGUF or a Hugging Face folder) runs emulated too, on the emulated nodes of
the mixed rig (`mesh serve --cpu-nodes 2 --emulate a100-80gb:1`: real OpenVINO agents beside
emulated GPU nodes): its name is then `shape:` and its architecture as JSON
(`shape_name`, from mesh.modelfiles.shape.architecture_of), and its profile on the device is
the roofline's (mesh.perf.roofline: the same model as the packaged reference profiles), so
that CPU-first placement, GPU fallback and moves run live on the real CPU engines.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from mesh.engines.emulated import EmulatedEngine, WallPace
from mesh.engines.engine_api import EngineError
from mesh.engines.simulated import SIMULATED_NOISE
from mesh.modelfiles.shape import layers_and_hidden
from mesh.perf.load_times import DEFAULT_CPU_MEMORY_BYTES, DEFAULT_GPU_MEMORY_BYTES, PCIE_BYTES_PER_S, ColdStart
from mesh.perf.model import PerformanceModel
from mesh.perf.profile import Profile, ProfileError, catalog_models, catalog_profile, device_kind
from mesh.perf.roofline import HARDWARE, Architecture, host_to_device_bytes_per_s, roofline_profile
from mesh.policy.dispatch_rules import CPU
from mesh.policy.node_spec import NodeSpec

ENGINE = "emulated"  # InstanceSpec.engine of an emulated instance
PROFILE_PREFIX = "emulated:"  # InstanceSpec.profile of an emulated instance: "emulated:<catalog name>"
SHAPE_PREFIX = "shape:"  # the name of a real model emulated from its architecture: "shape:<JSON>"


def shape_name(arch: Architecture) -> str:
    """The emulated name of a real model of architecture `arch` (module docstring)."""
    return SHAPE_PREFIX + json.dumps(asdict(arch), sort_keys=True, separators=(",", ":"))


def _shape_profile(name: str, device: str) -> Profile:
    """The roofline profile of the architecture in `name` on `device`; ProfileError if either is unusable."""
    try:
        arch = Architecture(**json.loads(name[len(SHAPE_PREFIX):]))
    except (ValueError, TypeError) as exc:
        raise ProfileError(f"not an architecture: {exc}") from None
    hardware = HARDWARE.get(device)
    if hardware is None:
        raise ProfileError(f"the roofline has no {device} (it has {', '.join(sorted(HARDWARE))})")
    return roofline_profile(arch, hardware)


@dataclass(frozen=True, slots=True)
class Emulation:
    """How an agent emulates: its device, the replay's noise and a seed."""

    device: str
    noise: float = SIMULATED_NOISE
    seed: int = 0
    profile_dir: str | None = None  # calibrated profiles <model>__<device>.json besides the packaged ones
    pace: WallPace = field(default_factory=WallPace, compare=False)  # this node's: its engines keep the profile's pace

    def profile(self, model: str) -> Profile:
        """The catalog's profile of `model` on this device; EngineError names what is wrong."""
        try:
            if model.startswith(SHAPE_PREFIX):
                return _shape_profile(model, self.device)
            return catalog_profile(model, self.device, self.profile_dir)
        except ProfileError as exc:
            shown = "a real model" if model.startswith(SHAPE_PREFIX) else repr(model)
            raise EngineError(f"cannot emulate {shown} on {self.device}: {exc}") from exc

    def engine(self, instance_id: str, model: str, uid: str, context_window: int | None, max_batch: int,
               load_s: float | None, layer_steps: Sequence[tuple[float, int]] | None = None) -> EmulatedEngine:
        """An instance of catalog model `model` (registered as `uid`) on this device. Its load
        takes `load_s`, what the replay's simulated engine's takes (InstanceSpec.emulated_load_s:
        the wait for the node's loads under way and the weights' load, not the KV cache
        allocation, which the node runtime does after it), else ColdStart's load of its weights;
        with `layer_steps` (InstanceSpec.emulated_layers) it serves from its first layer on."""
        p = self.profile(model)
        window = min(context_window or p.max_context, p.max_context)
        layers, hidden = layers_and_hidden(model)
        if load_s is None:
            load_s = emulated_cold_start([self.device], self.profile_dir).load_s(p.weight_bytes, p.device_kind)
        return EmulatedEngine(uid, PerformanceModel(p), kv_bytes_per_token=p.kv_bytes_per_token,
                              weight_bytes=p.weight_bytes, context_window=window, max_batch=max_batch,
                              load_s=load_s, noise=self.noise, pace=self.pace, num_layers=layers, hidden_size=hidden,
                              layer_steps=layer_steps,
                              seed=zlib.crc32(f"{self.seed}:{instance_id}".encode()))


def emulated_cold_start(devices: Iterable[str], profile_dir: str | Path | None = None, **kwargs: Any) -> ColdStart:
    """The replay's cold-start model for nodes emulating `devices`: a GPU load copies the
    weights from pinned host memory at the emulated GPU's measured (or assumed) bandwidth,
    the slowest of them if they differ (mesh.perf.roofline.host_to_device_bytes_per_s);
    `kwargs` go to ColdStart as they are."""
    gpus = [host_to_device_bytes_per_s(d, PCIE_BYTES_PER_S) for d in devices if device_kind(d, profile_dir) != CPU]
    return ColdStart(pcie_bytes_per_s=min(gpus, default=PCIE_BYTES_PER_S), **kwargs)


def model_of_profile(profile: str | None) -> str | None:
    """The catalog name in an emulated instance's profile reference, else None."""
    if profile and profile.startswith(PROFILE_PREFIX):
        return profile[len(PROFILE_PREFIX):]
    return None


def parse_emulate(text: str) -> list[tuple[str, int]]:
    """`DEVICE:N,DEVICE:N` -> [(device, count)]; ValueError says what is wrong."""
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        device, _, count = part.partition(":")
        try:
            n = int(count) if count else 1
        except ValueError:
            raise ValueError(f"--emulate {text!r}: {part!r} is not DEVICE:COUNT") from None
        if n < 1 or n > 64:
            raise ValueError(f"--emulate {text!r}: {device} needs 1 to 64 nodes, got {n}")
        out.append((device.strip(), n))
    if not out:
        raise ValueError("--emulate needs DEVICE:COUNT, e.g. xeon-6462c:4,a100-80gb:4")
    return out


def emulated_nodes(text: str, profile_dir: str | Path | None = None) -> tuple[list[NodeSpec], dict[str, str]]:
    """The nodes of `--emulate TEXT` and each node's device: ids cpu-0.., gpu-0.. by kind,
    memory as the replay's cluster gives that kind. ProfileError for an unknown device."""
    memory = {CPU: DEFAULT_CPU_MEMORY_BYTES, "gpu": DEFAULT_GPU_MEMORY_BYTES}
    nodes: list[NodeSpec] = []
    devices: dict[str, str] = {}
    counts = {CPU: 0, "gpu": 0}
    for device, n in parse_emulate(text):
        kind = device_kind(device, profile_dir)
        hw = HARDWARE.get(device)
        bytes_ = hw.memory_bytes if hw is not None and hw.kind != CPU and hw.memory_bytes else memory[kind]
        for _ in range(n):
            node_id = f"{kind}-{counts[kind]}"
            counts[kind] += 1
            nodes.append(NodeSpec(node_id, kind, bytes_))
            devices[node_id] = device
    return nodes, devices


def emulated_profiles(model: str, emulate: str, profile_dir: str | Path | None = None) -> list[Profile]:
    """`model`'s catalog profile on every device of `--emulate EMULATE` (one per device);
    ValueError names the devices that lack it and the models every device has."""
    devices = [d for d, _n in parse_emulate(emulate)]
    found, missing = [], []
    for device in devices:
        try:
            found.append(catalog_profile(model, device, profile_dir))
        except ProfileError:
            missing.append(device)
    if missing:
        common = set.intersection(*(set(catalog_models(d, profile_dir)) for d in devices))
        raise ValueError(f"no profile of {model!r} on {', '.join(missing)}; the emulated devices "
                         f"({', '.join(devices)}) all profile: {', '.join(sorted(common)) or 'none'}")
    return found
