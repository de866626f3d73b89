"""KV cache groups: which layers share block tables, as vLLM v1's hybrid KV cache manager groups them.

A model whose layers all attend the same way (every Llama) has one group: one block table per
sequence, one block id covering every layer. A model that interleaves sliding-window and full
attention layers (Gemma 2 and 3, GPT-OSS) wastes most of a full allocation on its sliding layers,
which only ever read the last `window` tokens. So layers are grouped by their window, into groups
of equal size G (the smallest type's layer count; a type whose count is not a multiple of G has one
group with fewer layers, and the missing layers' share of its blocks goes unused):

    Gemma-3-270m, 18 layers, every 6th full:   full: 3 layers      -> 1 group of 3
                                               sliding: 15 layers  -> 5 groups of 3

Every group draws blocks from ONE BlockPool, and a block id addresses G layers' worth of K/V: the
cache holds G tensor slots (worker/cache_engine.py) and layer l reads slot `slot_of[l]` with its
group's block table. A block belongs to one group at a time, so layers of different groups sharing
a slot never share a block. A sliding group frees the blocks its window has left
(kv/manager.py: remove_skipped_blocks), so a long sequence holds ~window tokens in each sliding
group instead of all of them.

No tensors here: the engine builds its manager from these groups, the worker its cache tensors.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]  # the model's layer indices, in slot order
    window: int  # 0: full attention (every block kept), else the sliding window in tokens

    @property
    def kind(self) -> str:
        return f"sliding {self.window}" if self.window else "full"


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]
    num_slots: int  # G: the cache's tensor slots, the layers one block id covers

    @property
    def hybrid(self) -> bool:
        """More than one group, or a group whose blocks leave a window: needs the hybrid manager."""
        return len(self.groups) > 1 or any(g.window for g in self.groups)

    def slot_of(self, num_layers: int) -> list[int]:
        """The cache slot of every layer."""
        slots = [0] * num_layers
        for g in self.groups:
            for s, layer in enumerate(g.layers):
                slots[layer] = s
        return slots

    def group_of(self, num_layers: int) -> list[int]:
        """The group index of every layer."""
        owner = [0] * num_layers
        for i, g in enumerate(self.groups):
            for layer in g.layers:
                owner[layer] = i
        return owner

    def blocks_per_seq(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """Blocks one sequence of num_tokens holds at most across the groups, when it computes at most
        max_chunk tokens a step: a sliding group holds the window behind the chunk's first query,
        the chunk, and one block the window may straddle (vLLM's SlidingWindowSpec bound)."""
        return sum(group_blocks(g.window, num_tokens, block_size, max_chunk) for g in self.groups)


    def chunk_blocks(self, max_chunk: int, block_size: int) -> int:
        """Blocks the sliding groups hold beyond every sequence's window while a step computes
        max_chunk tokens in all (the scheduler's token budget is shared by the whole batch)."""
        return sum(-(-max_chunk // block_size) for g in self.groups if g.window)


def group_blocks(window: int, num_tokens: int, block_size: int, max_chunk: int) -> int:
    full = -(-num_tokens // block_size)
    if not window:
        return full
    return min(full, -(-(window - 1 + max_chunk) // block_size) + 1)


def plan_groups(layer_windows: list[int], hybrid: bool = True) -> KVCacheGroups:
    """Group layers by window. hybrid=False (cache.hybrid_kv: false): one full group of every layer,
    the window then applies in compute only (every block kept, as without a window)."""
    n = len(layer_windows)
    if n == 0:
        raise ValueError("a model with no layers")
    kinds = sorted(set(layer_windows))
    if not hybrid or (len(kinds) == 1 and kinds[0] == 0):
        return KVCacheGroups((KVCacheGroup(tuple(range(n)), 0),), n)
    by_kind = {k: [i for i, w in enumerate(layer_windows) if w == k] for k in kinds}
    size = min(len(layers) for layers in by_kind.values())
    groups = []
    for kind in kinds:  # full (window 0) first: it anchors the prefix cache
        layers = by_kind[kind]
        groups.extend(KVCacheGroup(tuple(layers[i : i + size]), kind) for i in range(0, len(layers), size))
    return KVCacheGroups(tuple(groups), size)
