"""LoRA adapters on an OpenVINO instance: what OpenVINO GenAI 2026.4 allows, and the turns Mesh
makes of it (docs/service.md, "LoRA adapters").

What OpenVINO does: `ContinuousBatchingPipeline` applies adapters only in `generate()`, to the
whole batch, and keeps them as state of its infer request; `step()` ignores a request's
`GenerationConfig.adapters` and runs every request with the adapter applied last. Adapters
are matched to the model's weights by name, so the base must be an IR whose weights keep
Hugging Face's names (optimum's export); a GGUF's graph has anonymous weights and no adapter
applies to it. A pipeline built with an adapter in its properties takes, later, any adapter
of any rank on the modules that one covers.

What Mesh does: the pipeline is built with a zero rank-1 "slot" adapter on every projection
module (it changes no output); a *turn* is a run of requests with the same adapter (or none).
The adapter is switched in by a one-token `generate()` while the pipeline is empty (about
40 ms for the demo model on 2 cores); requests of another adapter wait outside the pipeline,
holding no KV, until the turn's requests end. Once another adapter waits, the turn takes no
newcomers, so no adapter waits for ever.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from pathlib import Path
from typing import Any, Iterable

from mesh.engines.engine_api import EngineError, EngineRequest, Sampling
from mesh.modelfiles.lora import MODULES, AdapterError, BaseLinears, adapter_tensors

Key = tuple[str | None, float]  # (adapter weights file, scale); (None, 1.0): the base
BASE: Key = (None, 1.0)
ADAPTERS_KEPT = 64  # adapters an instance keeps read (an adapter of the demo model: about 1 MB)


def key_of(sampling: Sampling) -> Key:
    return BASE if sampling.adapter is None else (sampling.adapter, sampling.adapter_scale)


def slot_adapter(model_folder: str | Path) -> Any | None:
    """The zero slot adapter (an openvino_genai.Adapter) for an IR folder whose config.json has
    a Llama-style shape; None where adapters cannot apply (no such config)."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai
    from safetensors.numpy import save

    try:
        base = BaseLinears.of_folder(model_folder)
    except AdapterError:
        return None
    data = save(adapter_tensors(base, rank=1, modules=MODULES, seed=None))
    return ov_genai.Adapter(ov.Tensor(np.frombuffer(data, dtype=np.uint8).copy()))


class AdapterTurns:
    """Which adapter the pipeline runs now, the requests waiting for their turn, and the
    adapters read so far."""

    def __init__(self) -> None:
        self.current: Key = BASE
        self.waiting: deque[EngineRequest] = deque()
        self._read: OrderedDict[str, Any] = OrderedDict()

    def must_wait(self, key: Key, busy: bool) -> bool:
        """Whether a new request with `key` waits: others wait before it, or the pipeline
        runs a turn of another adapter."""
        return bool(self.waiting) or (busy and key != self.current)

    def next_turn(self) -> tuple[Key, list[EngineRequest]]:
        """The next turn: the oldest waiting request's adapter and its waiting requests, in order."""
        key = key_of(self.waiting[0].sampling)
        turn = [r for r in self.waiting if key_of(r.sampling) == key]
        self.waiting = deque(r for r in self.waiting if key_of(r.sampling) != key)
        return key, turn

    def drop(self, request_id: str) -> bool:
        """Forget a waiting request; whether it was waiting."""
        kept = deque(r for r in self.waiting if r.request_id != request_id)
        dropped = len(kept) != len(self.waiting)
        self.waiting = kept
        return dropped

    def waiting_ids(self) -> Iterable[str]:
        return (r.request_id for r in self.waiting)

    def switch(self, pipe: Any, key: Key, model_name: str) -> None:
        """Apply `key`'s adapter to the (empty) pipeline: a one-token generate(), the only call
        that applies adapters in OpenVINO GenAI's continuous batching."""
        if key == self.current:
            return
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample, config.ignore_eos = 1, False, True
        config.adapters = self.config(key)
        try:
            if pipe.has_non_finished_requests():
                pipe.step()  # requests cancelled in the last step: an empty step frees them
            pipe.generate([ov.Tensor(np.array([[0]], dtype=np.int64))], [config])
        except RuntimeError as exc:
            raise EngineError(f"{model_name}: OpenVINO could not apply the adapter {key[0]}: "
                              f"{str(exc)[-300:]}") from exc
        self.current = key

    def config(self, key: Key) -> Any:
        """OpenVINO's AdapterConfig for `key` (an empty one for the base); adapters are read once."""
        import openvino_genai as ov_genai

        path, scale = key
        if path is None:
            return ov_genai.AdapterConfig()
        adapter = self._read.pop(path, None)
        if adapter is None:
            adapter = ov_genai.Adapter(path)
            while len(self._read) >= ADAPTERS_KEPT:
                self._read.popitem(last=False)
        self._read[path] = adapter
        return ov_genai.AdapterConfig(adapter, scale)
