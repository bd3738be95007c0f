"""A PyTorch engine that runs a contiguous range of a Llama-family model's decoder layers
(BlitzScale 5.2, lambdaScale 4.3): the layer-range side of mesh.engines.engine_api.

Plain PyTorch, no transformers: the Llama block is written here (RMSNorm, rotary position
embedding with the config's rope_theta, grouped-query attention, SiLU-gated MLP). The
range [start, stop) takes token ids (start == 0: it embeds them) or hidden states, and
gives hidden states (to the next range) or one sampled token per request (stop == the
model's layer count: final norm, LM head, greedy or temperature/top-p sampling). It keeps
a KV cache for its own layers only, per request, per layer (a request's position must
match what each layer holds, so a handover at the wrong position fails loudly).

One forward pass batches every request's tokens through the projections and the MLP; the
attention runs per request (their lengths differ). On CPU it computes in float32 (the
bfloat16 checkpoint is upcast); on CUDA, wherever torch sees a GPU, in bfloat16 unless told.

Weights come from a Hugging Face folder or a layer-ordered file (mesh.modelfiles.layer_order)
at once (`from_folder`), or block by block as they arrive (`receiving` + `receive_block`):
a layer loads once every block up to its end is in (mesh.policy.layer_prefix), and
`run_layers(..., stop=k)` runs the layers it has (a loading instance, BlitzScale 5.2).

torch is imported when an engine is made, so mesh.engines imports without it; the `layers`
extra installs it (pip install -e '.[layers]').
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Sequence

from mesh.engines.engine_api import DTYPE_BYTES, EngineError, HiddenStates, LayerRange, NextTokens, Sampling, TokenBatch
from mesh.modelfiles.layer_order import EMBED, FINAL_NORM, LM_HEAD, LayerLayout
from mesh.policy.layer_prefix import layers_in_prefix, prefix_bytes

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "install the layers extra: pip install -e '.[layers]' (scripts/setup.sh does it)"
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise EngineError(
            f"the layer-range engine needs PyTorch, which is not installed ({exc}); {INSTALL_HINT}") from exc
    return torch


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The model dimensions a Llama block needs, from config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "LlamaShape":
        kind = config.get("model_type")
        if kind != "llama":
            raise EngineError(f"the layer-range engine runs Llama-family models (model_type 'llama'), got {kind!r}")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise EngineError("the layer-range engine runs Llama blocks without biases; this config has "
                              "attention_bias or mlp_bias set")
        if config.get("hidden_act", "silu") != "silu":
            raise EngineError(f"the layer-range engine's MLP is SiLU-gated, the config asks {config['hidden_act']!r}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind != "default":
            raise EngineError(f"rope type {kind!r} is not supported by the layer-range engine (only 'default')")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = int(config["num_attention_heads"])
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        return cls(int(config["hidden_size"]), int(config["intermediate_size"]), int(config["num_hidden_layers"]),
                   heads, int(config.get("num_key_value_heads") or heads),
                   int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                   float(config.get("rms_norm_eps", 1e-6)), float(theta), int(config["vocab_size"]),
                   bool(config.get("tie_word_embeddings", False)), eos_ids)


@dataclass(slots=True)
class _Block:
    """One decoder layer's weights, q/k/v and gate/up fused."""

    input_norm: "torch.Tensor"
    qkv: "torch.Tensor"
    o: "torch.Tensor"
    post_norm: "torch.Tensor"
    gate_up: "torch.Tensor"
    down: "torch.Tensor"


@dataclass(slots=True)
class _KV:
    """One request's KV cache for the engine's layers: (capacity, kv heads, head dim) per
    layer, the first `lengths[i]` rows of layer i in use."""

    keys: list["torch.Tensor | None"]
    values: list["torch.Tensor | None"]
    lengths: list[int]
    generator: "torch.Generator | None" = None


@dataclass
class _Incoming:
    """Blocks of a layer-ordered file received so far (by index), and the spans of all."""

    layout: LayerLayout
    spans: list[tuple[int, int]]
    blocks: dict[int, bytes] = field(default_factory=dict)  # bytes still needed, by block index
    received: set[int] = field(default_factory=set)

    def read(self, start: int, end: int) -> bytes:
        out = bytearray()
        for i, (offset, size) in enumerate(self.spans):
            if offset + size <= start or offset >= end:
                continue
            data = self.blocks[i]
            out += data[max(start - offset, 0):min(end - offset, size)]
        return bytes(out)


class TorchLayerEngine:
    """Decoder layers `layer_range` of a Llama-family model, on CPU or CUDA (module docstring)."""

    runs_layer_ranges = True

    def __init__(self, shape: LlamaShape, layer_range: LayerRange, *, device: str | None = None,
                 dtype: str | None = None, model_name: str = "model") -> None:
        torch = _torch()
        if layer_range.num_layers != shape.num_layers:
            raise EngineError(f"layer range of a {layer_range.num_layers}-layer model given for {model_name}, which "
                              f"has {shape.num_layers} layers")
        self.torch = torch
        self.shape = shape
        self.model_name = model_name
        self.layer_range = layer_range
        self.hidden_size = shape.hidden_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        if self.dtype not in DTYPE_BYTES:
            raise EngineError(f"compute dtype {self.dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
        self._tdtype = getattr(torch, self.dtype)
        self._embed: "torch.Tensor | None" = None
        self._norm: "torch.Tensor | None" = None
        self._head: "torch.Tensor | None" = None
        self._blocks: list[_Block | None] = [None] * layer_range.count
        self._kv: dict[str, _KV] = {}
        self._incoming: _Incoming | None = None
        half = shape.head_dim // 2
        self._inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, half, dtype=torch.float64) * 2 / shape.head_dim))
        self.kv_bytes_per_token = 2 * layer_range.count * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[self.dtype]

    # --- weights ---------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path, layer_range: LayerRange | None = None, *, device: str | None = None,
                    dtype: str | None = None, model_name: str | None = None) -> "TorchLayerEngine":
        """Load layers `layer_range` (all: None) from a Hugging Face folder (config.json,
        *.safetensors) or a layer-ordered safetensors file."""
        torch = _torch()
        try:
            from safetensors import safe_open
        except ImportError as exc:
            raise EngineError(f"the layer-range engine needs safetensors ({exc}); {INSTALL_HINT}") from exc
        p = Path(path)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise EngineError(f"{p} has no config.json; give a Hugging Face model folder")
            config = json.loads((p / "config.json").read_text())
            files = sorted(p.glob("*.safetensors"))
        elif p.is_file():
            from mesh.modelfiles.layer_order import CONFIG_KEY
            with safe_open(str(p), "pt") as f:
                meta = f.metadata() or {}
            if CONFIG_KEY not in meta:
                raise EngineError(f"{p} carries no config; give a Hugging Face folder or a layer-ordered file "
                                  "(mesh.modelfiles.layer_order.write_layer_ordered)")
            config, files = json.loads(meta[CONFIG_KEY]), [p]
        else:
            raise EngineError(f"{p} does not exist; give a Hugging Face model folder or a layer-ordered file")
        if not files:
            raise EngineError(f"{p} holds no *.safetensors file")
        shape = LlamaShape.from_config(config)
        engine = cls(shape, layer_range or LayerRange.whole(shape.num_layers), device=device, dtype=dtype,
                     model_name=model_name or p.name)
        where: dict[str, Any] = {}
        with contextlib.ExitStack() as stack:
            for f in files:
                h = stack.enter_context(safe_open(str(f), "pt"))
                where.update(dict.fromkeys(h.keys(), h))
            with torch.inference_mode():
                engine._load(lambda name: where[name].get_tensor(name) if name in where else None,
                             layers=range(engine.layer_range.count))
        return engine

    @classmethod
    def receiving(cls, layout: LayerLayout, block_spans: Sequence[tuple[int, int]],
                  layer_range: LayerRange | None = None, *, device: str | None = None, dtype: str | None = None,
                  model_name: str = "model") -> "TorchLayerEngine":
        """An engine whose weights arrive as the blocks (offset, size) of a layer-ordered
        file, in any order; `receive_block` hands each one in (block 0 gives `layout`:
        mesh.modelfiles.layer_order.read_layout)."""
        shape = LlamaShape.from_config(layout.config)
        engine = cls(shape, layer_range or LayerRange.whole(shape.num_layers), device=device, dtype=dtype,
                     model_name=model_name)
        engine._incoming = _Incoming(layout, [(int(o), int(s)) for o, s in block_spans])
        return engine

    def receive_block(self, index: int, data: bytes) -> int:
        """Take block `index` (checked by the caller); load every part of this range that
        the gap-free prefix of blocks now holds. Returns `layers_ready()`."""
        inc = self._incoming
        if inc is None:
            raise EngineError("this engine loaded its weights at once; only an engine made by receiving() takes blocks")
        if not 0 <= index < len(inc.spans) or len(data) != inc.spans[index][1]:
            raise EngineError(f"block {index} ({len(data)} B) is not one of the {len(inc.spans)} blocks this engine "
                              "expects; give blocks of the manifest the engine was made with")
        inc.blocks[index] = bytes(data)
        inc.received.add(index)
        prefix = prefix_bytes(inc.received, [s for _, s in inc.spans])
        spans, tensors, torch = inc.layout.spans, inc.layout.tensors, self.torch

        def get(name: str) -> "torch.Tensor | None":
            t = tensors.get(name)
            if t is None or t.end > prefix:
                return None
            raw = bytearray(inc.read(t.start, t.end))
            dt = getattr(torch, _ST_DTYPES[t.dtype])
            return torch.frombuffer(raw, dtype=dt).reshape(t.shape) if raw else torch.empty(t.shape, dtype=dt)

        usable = layers_in_prefix(spans, prefix)
        start = self.layer_range.start
        todo = [i for i in range(self.layer_range.count) if self._blocks[i] is None and start + i < usable]
        with torch.inference_mode():
            self._load(get, layers=todo, head=prefix >= spans.total_bytes)
        self._drop_consumed(prefix)
        return self.layers_ready()

    def _drop_consumed(self, prefix: int) -> None:
        """Forget received blocks that end before every tensor this range still lacks."""
        inc = self._incoming
        assert inc is not None
        r, tensors = self.layer_range, inc.layout.tensors
        names = [f"model.layers.{r.start + i}." for i, b in enumerate(self._blocks) if b is None]
        lacking = [t.start for t in tensors.values() if any(t.name.startswith(n) for n in names)]
        if self._embed is None and (r.first or (r.last and self.shape.tie_word_embeddings)):
            lacking.append(tensors[EMBED].start)
        if r.last and self._norm is None:
            lacking += [tensors[n].start for n in (FINAL_NORM, LM_HEAD) if n in tensors]
        keep_from = min(lacking, default=inc.layout.spans.total_bytes)
        for i in [i for i in inc.blocks if sum(inc.spans[i]) <= keep_from]:
            del inc.blocks[i]

    def _load(self, get: Callable[[str], "torch.Tensor | None"], layers: Collection[int], head: bool = True) -> None:
        """Bring in the parts of this range that `get` can give: the embedding (first range,
        or a tied LM head), the layers `layers` (indices into the range), the final norm and
        head (last range, when `head`)."""
        torch, r = self.torch, self.layer_range

        def cast(t: "torch.Tensor") -> "torch.Tensor":
            return t.to(device=self.device, dtype=self._tdtype, copy=True).contiguous()

        def need(name: str) -> "torch.Tensor":
            t = get(name)
            if t is None:
                raise EngineError(f"{self.model_name}: tensor {name} is missing from the weights")
            return t

        wants_embed = r.first or (r.last and self.shape.tie_word_embeddings)
        if wants_embed and self._embed is None:
            t = get(EMBED)
            if t is not None:
                self._embed = cast(t)
        for i in layers:
            p = f"model.layers.{r.start + i}."
            parts = {n: get(p + n) for n in ("input_layernorm.weight", "self_attn.q_proj.weight",
                                             "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                             "self_attn.o_proj.weight", "post_attention_layernorm.weight",
                                             "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
            missing = [n for n, t in parts.items() if t is None]
            if missing:
                raise EngineError(f"{self.model_name}: layer {r.start + i} lacks {p}{missing[0]}")
            self._blocks[i] = _Block(
                cast(parts["input_layernorm.weight"]),
                cast(torch.cat([parts["self_attn.q_proj.weight"], parts["self_attn.k_proj.weight"],
                                parts["self_attn.v_proj.weight"]])),
                cast(parts["self_attn.o_proj.weight"]), cast(parts["post_attention_layernorm.weight"]),
                cast(torch.cat([parts["mlp.gate_proj.weight"], parts["mlp.up_proj.weight"]])),
                cast(parts["mlp.down_proj.weight"]))
        if r.last and head and self._norm is None:
            norm = get(FINAL_NORM)
            lm = get(LM_HEAD)
            if norm is not None and (lm is not None or self.shape.tie_word_embeddings):
                self._norm = cast(norm)
                self._head = cast(lm) if lm is not None else None
        if self._incoming is None and not self.ready():
            raise EngineError(f"{self.model_name}: the weights lack the embedding, final norm or LM head that "
                              f"layers [{r.start}, {r.stop}) need")

    def share(self, layer_range: LayerRange) -> "TorchLayerEngine":
        """An engine for `layer_range`, a part of this one's, over the same weight tensors
        (no copy) with a KV cache of its own: a node holding the whole model runs any range."""
        r = self.layer_range
        if not (r.start <= layer_range.start and layer_range.stop <= r.start + self.layers_ready()
                and layer_range.num_layers == r.num_layers):
            raise EngineError(f"layers [{layer_range.start}, {layer_range.stop}) are not among the loaded layers "
                              f"[{r.start}, {r.start + self.layers_ready()}) of this engine")
        if layer_range.last and not self.head_ready():
            raise EngineError("the range ends the model, but this engine holds no final norm and LM head")
        if layer_range.first and self._embed is None:
            raise EngineError("the range starts the model, but this engine holds no embedding")
        out = TorchLayerEngine(self.shape, layer_range, device=str(self.device), dtype=self.dtype,
                               model_name=self.model_name)
        out._embed, out._norm, out._head = self._embed, self._norm, self._head
        out._blocks = self._blocks[layer_range.start - r.start:layer_range.stop - r.start]
        return out

    def layers_ready(self) -> int:
        """Layers of the range, from its start, whose weights are in (and the embedding, for a first range)."""
        if self.layer_range.first and self._embed is None:
            return 0
        n = 0
        while n < len(self._blocks) and self._blocks[n] is not None:
            n += 1
        return n

    def head_ready(self) -> bool:
        """A last range holds its final norm and LM head (the embedding too, when tied)."""
        return self._norm is not None and (self._head is not None or self._embed is not None)

    def ready(self) -> bool:
        """Every weight of the range is in."""
        return self.layers_ready() == self.layer_range.count and (not self.layer_range.last or self.head_ready())

    @property
    def weight_bytes(self) -> int:
        tensors = [self._embed, self._norm, self._head] + [t for b in self._blocks if b is not None
                                                           for t in (b.input_norm, b.qkv, b.o, b.post_norm,
                                                                     b.gate_up, b.down)]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # --- requests ---------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

    def kv_tokens(self, request_id: str) -> int:
        """Tokens request `request_id` holds in this range's first layer's KV cache (0 if none)."""
        kv = self._kv.get(request_id)
        return kv.lengths[0] if kv else 0

    def kv_bytes_in_use(self) -> int:
        per_layer = 2 * self.shape.num_kv_heads * self.shape.head_dim * DTYPE_BYTES[self.dtype]
        return sum(n * per_layer for kv in self._kv.values() for n in kv.lengths)

    @property
    def request_ids(self) -> list[str]:
        return list(self._kv)

    # --- compute ----------------------------------------------------------------------------

    def run_layers(self, batch: TokenBatch | HiddenStates, sampling: Mapping[str, Sampling] | None = None,
                   stop: int | None = None) -> HiddenStates | NextTokens:
        """One forward pass of layers [start, stop) (the whole range: None) over `batch`
        (see LayerRangeEngine.run_layers). A `stop` short of the range's end gives hidden
        states for layer `stop`: a loading instance runs the layers it holds. Hidden states
        start at their own layer, anywhere in the range: a partner holding the whole model runs
        the layers [T, L) a loading instance left (BlitzScale 5.2)."""
        torch, r = self.torch, self.layer_range
        stop = r.stop if stop is None else stop
        if not r.start < stop <= r.stop:
            raise EngineError(f"stop={stop} is outside layers ({r.start}, {r.stop}] of this engine")
        ready = self.layers_ready()
        if stop - r.start > ready or (stop == r.num_layers and not self.head_ready()):
            raise EngineError(f"{self.model_name}: layers [{r.start}, {r.start + ready}) of [{r.start}, {r.stop}) "
                              f"hold weights{'' if self.head_ready() or not r.last else ', the head does not'}; "
                              f"run up to layer {r.start + ready} or wait for more blocks")
        with torch.inference_mode():
            if isinstance(batch, TokenBatch):
                if not r.first:
                    raise EngineError(f"layers [{r.start}, {r.stop}) take hidden states, not token ids; send token "
                                      "ids to the range that starts at layer 0")
                ids = torch.tensor([t for ids in batch.token_ids for t in ids], dtype=torch.long, device=self.device)
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape.vocab_size):
                    raise EngineError(
                        f"a token id is outside {self.model_name}'s vocabulary of {self.shape.vocab_size}")
                x = self._embed[ids]  # type: ignore[index]
                counts = batch.token_counts
                start = r.start
            else:
                if not r.start <= batch.layer < stop:
                    raise EngineError(f"hidden states for layer {batch.layer} sent to layers [{r.start}, {stop}); "
                                      f"send them to the range that holds layer {batch.layer}")
                start = batch.layer
                if batch.hidden_size != self.hidden_size:
                    raise EngineError(f"hidden states of size {batch.hidden_size}, the model's is {self.hidden_size}")
                x = self._from_bytes(batch)
                counts = batch.token_counts
            positions = batch.positions
            kvs = self._caches(batch.request_ids, positions, counts, start, stop)
            pos = torch.cat([torch.arange(p, p + n, dtype=torch.float64) for p, n in zip(positions, counts)])
            freqs = pos[:, None] * self._inv_freq[None, :]
            cos = torch.cos(freqs).to(self.device, self._tdtype)
            sin = torch.sin(freqs).to(self.device, self._tdtype)
            for layer in range(start, stop):
                x = self._layer(layer - r.start, x, cos, sin, kvs, positions, counts)
            for kv, n in zip(kvs, counts):
                for i in range(start, stop):
                    kv.lengths[i - r.start] += n
            if stop < r.num_layers:
                return self._to_hidden(stop, batch.request_ids, positions, counts, x)
            return self._sample(batch.request_ids, counts, x, sampling or {})

    def _caches(self, request_ids: Sequence[str], positions: Sequence[int], counts: Sequence[int], start: int,
                stop: int) -> list[_KV]:
        if len(set(request_ids)) != len(request_ids):
            raise EngineError("a request appears twice in one batch; send each request once")
        out = []
        for rid, p in zip(request_ids, positions):
            kv = self._kv.get(rid)
            if kv is None:
                n = self.layer_range.count
                kv = _KV([None] * n, [None] * n, [0] * n)
            have = kv.lengths[start - self.layer_range.start:stop - self.layer_range.start]
            bad = next((start + i for i, h in enumerate(have) if h != p), None)
            if bad is not None:
                raise EngineError(f"request {rid!r} comes at position {p}, but layer {bad} holds "
                                  f"{have[bad - start]} of its tokens; send it from position {have[bad - start]}, "
                                  "or release it and prefill it again from position 0")
            out.append(kv)
        for rid, kv in zip(request_ids, out):
            self._kv.setdefault(rid, kv)
        return out

    def _from_bytes(self, h: HiddenStates) -> "torch.Tensor":
        torch = self.torch
        t = torch.frombuffer(bytearray(h.data), dtype=getattr(torch, h.dtype)).reshape(h.tokens, h.hidden_size)
        return t.to(device=self.device, dtype=self._tdtype)

    def _to_hidden(self, layer: int, request_ids: Sequence[str], positions: Sequence[int], counts: Sequence[int],
                   x: "torch.Tensor") -> HiddenStates:
        torch = self.torch
        data = x.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        return HiddenStates(layer, tuple(request_ids), tuple(positions), tuple(counts), self.hidden_size,
                            self.dtype, data)

    def _norm_rows(self, x: "torch.Tensor", weight: "torch.Tensor") -> "torch.Tensor":
        torch = self.torch
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def _layer(self, i: int, x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor", kvs: list[_KV],
               positions: Sequence[int], counts: Sequence[int]) -> "torch.Tensor":
        torch, s = self.torch, self.shape
        F = torch.nn.functional
        b = self._blocks[i]
        assert b is not None
        n_tok, hd = x.shape[0], s.head_dim
        qkv = self._norm_rows(x, b.input_norm) @ b.qkv.T
        q, k, v = qkv.split([s.num_heads * hd, s.num_kv_heads * hd, s.num_kv_heads * hd], dim=-1)
        q = _rope(torch, q.reshape(n_tok, s.num_heads, hd), cos, sin)
        k = _rope(torch, k.reshape(n_tok, s.num_kv_heads, hd), cos, sin)
        v = v.reshape(n_tok, s.num_kv_heads, hd)
        group = s.num_heads // s.num_kv_heads
        outs, row = [], 0
        for kv, p, n in zip(kvs, positions, counts):
            keys, values = self._append(kv, i, p, k[row:row + n], v[row:row + n])
            qh = q[row:row + n].transpose(0, 1)  # (heads, n, hd)
            kh = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # (heads, p + n, hd)
            vh = values.transpose(0, 1).repeat_interleave(group, dim=0)
            mask = None
            if n > 1:
                mask = (torch.arange(p + n, device=self.device)[None, :]
                        <= torch.arange(p, p + n, device=self.device)[:, None])
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0 / math.sqrt(hd))
            outs.append(o.transpose(0, 1).reshape(n, s.num_heads * hd))
            row += n
        x = x + torch.cat(outs) @ b.o.T
        gate, up = (self._norm_rows(x, b.post_norm) @ b.gate_up.T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ b.down.T

    def _append(self, kv: _KV, i: int, p: int, k: "torch.Tensor", v: "torch.Tensor"
                ) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Write a request's new keys and values of layer i at rows p.. of its cache; return
        rows [0, p + n) of both."""
        torch = self.torch
        end = p + k.shape[0]
        cur = kv.keys[i]
        if cur is None or cur.shape[0] < end:
            cap = max(end, 16, 2 * (cur.shape[0] if cur is not None else 0))
            nk = torch.empty((cap, *k.shape[1:]), dtype=k.dtype, device=self.device)
            nv = torch.empty_like(nk)
            if cur is not None:
                nk[:p] = cur[:p]
                nv[:p] = kv.values[i][:p]  # type: ignore[index]
            kv.keys[i], kv.values[i] = nk, nv
        kv.keys[i][p:end] = k  # type: ignore[index]
        kv.values[i][p:end] = v  # type: ignore[index]
        return kv.keys[i][:end], kv.values[i][:end]  # type: ignore[index]

    def _sample(self, request_ids: Sequence[str], counts: Sequence[int], x: "torch.Tensor",
                sampling: Mapping[str, Sampling]) -> NextTokens:
        torch = self.torch
        last = torch.tensor([sum(counts[:j + 1]) - 1 for j in range(len(counts))], device=self.device)
        h = self._norm_rows(x[last], self._norm)  # type: ignore[arg-type]
        head = self._head if self._head is not None else self._embed
        logits = (h @ head.T).float()  # type: ignore[union-attr]
        tokens = [_pick(torch, logits[j], sampling.get(rid), self._kv[rid], self.device)
                  for j, rid in enumerate(request_ids)]
        return NextTokens(tuple(request_ids), tuple(tokens))


def _pick(torch: Any, logits: "torch.Tensor", sp: Sampling | None, kv: _KV, device: Any) -> int:
    """One request's next token: greedy, or temperature and top-p with the request's own
    seeded generator (kept with its KV cache)."""
    if sp is None or sp.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sp.temperature, dim=-1)
    if sp.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    if kv.generator is None:
        kv.generator = torch.Generator(device=device)
        kv.generator.manual_seed(sp.seed if sp.seed is not None else int(torch.seed()))
    return int(torch.multinomial(probs, 1, generator=kv.generator))


def _rope(torch: Any, x: "torch.Tensor", cos: "torch.Tensor", sin: "torch.Tensor") -> "torch.Tensor":
    """Rotary position embedding, the Hugging Face Llama layout (halves rotated): x is
    (tokens, heads, head_dim), cos/sin (tokens, head_dim / 2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
