"""Which decoder layers a receiver can run from the blocks it holds (BlitzScale 5.2,
lambdaScale 4.3).

A layer-ordered model file holds, one after the other: its header and the token
embedding, decoder layer 0, layer 1, ..., then the final norm and the LM head
(mesh.modelfiles.layer_order writes one). `LayerSpans` gives the byte offset where each of
these parts ends. Blocks (mesh.weights.blocks) tile the file in order.

- `usable_layers`: the layers a loading instance runs as a prefix of the model
  (BlitzScale 5.2's cooperative execution): a layer counts once every block before its
  end is in, so a block that arrives ahead of a missing one adds nothing until the gap
  fills.
- `complete_layers`: the layers whose bytes are all in, in any order: what a member of an
  execution pipeline could run (lambdaScale 4.3, receivers holding different blocks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence


@dataclass(frozen=True, slots=True)
class LayerSpans:
    """Where the parts of a layer-ordered file end: `embed_end` (header and embedding),
    `layer_ends[i]` (decoder layer i), `total_bytes` (the final norm and LM head)."""

    embed_end: int
    layer_ends: tuple[int, ...]
    total_bytes: int

    def __post_init__(self) -> None:
        ends = (self.embed_end, *self.layer_ends, self.total_bytes)
        if self.embed_end <= 0 or any(b < a for a, b in zip(ends, ends[1:])):
            raise ValueError(f"layer spans must end in file order after a non-empty embedding, got {ends}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ends)

    def layer_start(self, layer: int) -> int:
        return self.embed_end if layer == 0 else self.layer_ends[layer - 1]

    def boundaries(self) -> list[int]:
        """Offsets where a block may end on a part's boundary (for blocks.cut/pack)."""
        return [self.embed_end, *self.layer_ends]


def contiguous_blocks(received: Collection[int], count: int) -> int:
    """How many blocks from block 0 are all in (0..k-1 received)."""
    k = 0
    while k < count and k in received:
        k += 1
    return k


def prefix_bytes(received: Collection[int], block_sizes: Sequence[int]) -> int:
    """Bytes from the file's start covered without a gap by the received blocks."""
    return sum(block_sizes[:contiguous_blocks(received, len(block_sizes))])


def usable_layers(spans: LayerSpans, received: Collection[int], block_sizes: Sequence[int]) -> int:
    """The number of decoder layers, from layer 0, that a receiver can run: the embedding
    and each of those layers lie inside the gap-free prefix of received blocks."""
    return layers_in_prefix(spans, prefix_bytes(received, block_sizes))


def layers_in_prefix(spans: LayerSpans, prefix: int) -> int:
    """Decoder layers, from layer 0, that the first `prefix` bytes of the file hold whole
    (0 until the embedding is in)."""
    if prefix < spans.embed_end:
        return 0
    n = 0
    while n < spans.num_layers and spans.layer_ends[n] <= prefix:
        n += 1
    return n


def head_ready(spans: LayerSpans, received: Collection[int], block_sizes: Sequence[int]) -> bool:
    """The whole file is in without a gap: the final norm and LM head too."""
    return prefix_bytes(received, block_sizes) >= spans.total_bytes


def complete_layers(spans: LayerSpans, received: Collection[int], block_sizes: Sequence[int]) -> frozenset[int]:
    """Decoder layers whose every byte is in a received block, whatever the order they came in."""
    have: list[tuple[int, int]] = []
    offset = 0
    for index, size in enumerate(block_sizes):
        if index in received:
            if have and have[-1][1] == offset:
                have[-1] = (have[-1][0], offset + size)
            else:
                have.append((offset, offset + size))
        offset += size
    return frozenset(layer for layer in range(spans.num_layers)
                     if any(a <= spans.layer_start(layer) and spans.layer_ends[layer] <= b for a, b in have))
