"""What one model step tells the attention backend: where each token's K/V goes and what it may see.

The scheduler decides *which* tokens run; the model runner turns that decision into this flat,
tensor-only description. Backends read nothing else, so the same metadata drives the torch
backend, the CuPy kernels on a GPU and the same kernels run through the CPU harness.

Tokens of all sequences in a step are packed one after another ("varlen" layout):

    tokens:          | seq0: q0 q1 q2 | seq1: q0 | seq2: q0 q1 |
    query_start_loc:   0               3          4            6
    seq_lens:          context0 + 3    context1+1 context2 + 2
    context_lens:      tokens already in the cache before this step (prefix hits, earlier steps)

Sequence i's queries are tokens query_start_loc[i]:query_start_loc[i+1]; its query j sits at
absolute position context_lens[i] + j and attends (causally) to cache positions 0..context_lens[i]+j.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat cache slot (block_id * block_size + offset) for each new token's K/V;
    # a negative slot means "do not write" (padding).
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: prefix sums of query lengths.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: tokens in the cache for each sequence once this step has written its K/V.
    seq_lens: torch.Tensor
    # [num_seqs] int32: tokens already in the cache before this step (seq_lens - query lengths).
    context_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: physical block ids, padded with 0 past each table's end.
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Python-side copies of the small per-sequence vectors, so backends need no device sync to loop.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # What a backend derives from this step once and reuses in every layer (block tables gathered
    # per kernel row, device copies, wrapped arrays): pagedrun/attention/cuda/paged_step.py.
    backend_state: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, *, num_pad_tokens: int = 0, table_width: int | None = None,
              device: torch.device | str = "cpu") -> AttentionMetadata:
        """Sequence i computes query_lens[i] tokens after context_lens[i] cached ones, through
        block_tables[i]; num_pad_tokens trailing tokens get slot -1 (neither written nor read)."""
        slots = _slots(query_lens, context_lens, block_tables, block_size)
        slots.extend([-1] * num_pad_tokens)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        tables = _tables(block_tables, table_width)
        return cls(
            slot_mapping=vector(slots, np.int64, device),
            query_start_loc=vector(starts, np.int32, device),
            seq_lens=vector(seq_lens, np.int32, device),
            context_lens=vector(context_lens, np.int32, device),
            block_tables=tables.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            query_lens_list=list(query_lens),
            seq_lens_list=seq_lens,
        )

    @classmethod
    def build_groups(cls, query_lens: list[int], context_lens: list[int], group_tables: list[list[list[int]]],
                     block_size: int, *, device: torch.device | str = "cpu") -> list[AttentionMetadata]:
        """One metadata per KV cache group (group_tables[g][i]: sequence i's table in group g): the
        first built in full, the others sharing its per-sequence tensors and lists, with their own
        slot mapping and block tables (the only fields that differ between groups)."""
        first = cls.build(query_lens, context_lens, group_tables[0], block_size, device=device)
        out = [first]
        for tables in group_tables[1:]:
            slots = vector(_slots(query_lens, context_lens, tables, block_size), np.int64, device)
            out.append(dataclasses.replace(first, slot_mapping=slots, block_tables=_tables(tables).to(device),
                                           backend_state={}))
        return out

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """Every sequence contributes exactly one query token: the paged decode kernels apply."""
        return self.max_query_len == 1


def vector(values: list, dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of a list of ints (or of equal-length lists), through numpy: a third of torch.tensor's host time on a list
    of a step's length (docs/log/2026-11-28-host-step.md)."""
    return torch.from_numpy(np.array(values, dtype=dtype)).to(device)


def _slots(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int) -> list[int]:
    """The cache slot of every new token, sequence after sequence."""
    if all(q == 1 for q in query_lens):  # a decode step: one slot per sequence, no generator per row
        return [t[c // block_size] * block_size + c % block_size for t, c in zip(block_tables, context_lens)]
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    return slots


def _tables(block_tables: list[list[int]], table_width: int | None = None) -> torch.Tensor:
    """[num_seqs, width] int32, each table padded with 0."""
    n = len(block_tables)
    counts = np.fromiter(map(len, block_tables), dtype=np.int64, count=n)
    width = table_width or (int(counts.max()) if n else 0)
    # One numpy write of every table's blocks through a row-major mask: padded Python lists, or a
    # tensor per row, were a visible cost of a decode step (docs/log/2026-11-26-python-between-kernels.md,
    # docs/log/2026-11-28-host-step.md).
    out = np.zeros((n, width), dtype=np.int32)  # [0, width] when there are no sequences
    cols = _COLS[:width] if width <= len(_COLS) else np.arange(width)
    out[cols < counts[:, None]] = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32,
                                                       count=int(counts.sum()))
    return torch.from_numpy(out)


_COLS = np.arange(1 << 16)


# What a model's forward takes: one metadata for every layer, or one per layer. With the hybrid KV
# manager each KV cache group (the layers of one attention type) has its own block tables and slot
# mapping, so layers of different groups get different objects; every other field (query_start_loc,
# seq_lens, context_lens, the positions) is the same in all of them. Layers of one group share one
# object, which backends may rely on (backend_state is filled by the group's first layer).
StepMetadata = Union[AttentionMetadata, Sequence[AttentionMetadata]]


def per_layer(meta: StepMetadata, num_layers: int) -> Sequence[AttentionMetadata]:
    """The metadata of each of num_layers layers."""
    if isinstance(meta, AttentionMetadata):
        return [meta] * num_layers
    if len(meta) != num_layers:
        raise ValueError(f"{len(meta)} attention metadata for {num_layers} layers")
    return meta
