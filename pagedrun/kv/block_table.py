"""A sequence's block table: logical block i of the sequence lives in physical block block_ids[i].

Position p of the sequence is slot block_ids[p // block_size] * block_size + p % block_size in the
flat cache (see pagedrun/attention/backend.py for the layout). The table always covers exactly
num_tokens slots: len(block_ids) == ceil(num_tokens / block_size).

A sliding-window group's table (kv/groups.py) gives back the blocks its window has left: their
entries become NULL_BLOCK, always a leading run of num_null entries (positions below the window
of every later query, never read again). What the kernels see there is a placeholder
(KVCacheManager.get_block_table), never read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NULL_BLOCK = -1  # a table entry whose block was freed because it left the window


@dataclass
class BlockTable:
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # slots reserved (positions 0 .. num_tokens-1 are mapped)
    num_null: int = 0  # leading entries that are NULL_BLOCK (sliding-window groups only)

    @property
    def live_block_ids(self) -> list[int]:
        """The entries that hold a block (every entry but the leading NULL_BLOCK run)."""
        return self.block_ids[self.num_null :] if self.num_null else self.block_ids

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def capacity(self) -> int:
        """Slots the table can hold without a new block."""
        return len(self.block_ids) * self.block_size

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, position: int) -> int:
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside the {self.num_tokens} reserved slots")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions start .. end-1 (the slot_mapping of one sequence's new tokens)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"range [{start}, {end}) outside the {self.num_tokens} reserved slots")
        bs = self.block_size
        ids = self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)]

    def copy(self) -> "BlockTable":
        return BlockTable(self.block_size, list(self.block_ids), self.num_tokens, self.num_null)
