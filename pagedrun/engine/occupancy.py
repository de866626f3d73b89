"""The KV occupancy the report reads after every step (metrics.StepRecord): what the running
sequences hold in the paged cache, and what a contiguous cache would reserve for them."""
from __future__ import annotations


def occupancy(running, kv, max_model_len: int) -> dict:
    """Slots holding computed KV and slots assigned to tokens, each distinct block counted once
    (forked children and prefix hits share blocks), tokens held per sequence, and the contiguous
    reservation the same sequences would need (the report's what-if; computed, not allocated).

    Per sequence the unshared blocks hold exactly its computed / assigned tokens; only shared
    blocks (a leading run of each table, KVCacheManager.shared_prefix_blocks) need the
    per-block max over their holders. So the cost per step is the number of running sequences
    plus shared blocks, not every block of every table.

    With KV cache groups (kv/hybrid.py) slots are counted in every group (a block of each holds
    its own layers' K/V), from the first position the group still holds: a sliding group's table
    starts with the entries its window gave back (blocks_left_window counts them)."""
    logical = reserved = 0
    for g in running:
        want = min(g.prompt_len + g.sampling.max_tokens, max_model_len)
        for seq in g.unfinished_seqs():
            logical += seq.num_computed_tokens
            reserved += want
    stored = assigned = left = 0
    for manager in getattr(kv, "managers", (kv,)):
        s, a, n = _held(running, manager)
        stored, assigned, left = stored + s, assigned + a, left + n
    return {"tokens_stored": stored, "tokens_assigned": assigned,
            "tokens_logical": logical, "reserved_contiguous_tokens": reserved,
            "num_running_requests": len(running), "blocks_left_window": left}


def _held(running, kv) -> tuple[int, int, int]:
    """(slots holding computed KV, slots assigned, table entries given back to the window) of one
    group's tables."""
    bs = kv.block_size
    stored = assigned = left = 0
    shared: dict[int, list[tuple[int, int]]] = {}  # block -> (assigned, stored) per holder
    for g in running:
        for seq in g.unfinished_seqs():
            computed = seq.num_computed_tokens
            slots = kv.get_num_tokens(seq.seq_id)
            gone = kv.num_left_window(seq.seq_id)
            left += gone
            first = gone * bs  # the first position whose block the table still holds
            stored += max(0, computed - first)
            assigned += max(0, slots - first)
            for i, b in enumerate(kv.shared_prefix_blocks(seq.seq_id), gone):
                shared.setdefault(b, []).append((min(bs, max(0, slots - i * bs)),
                                                 min(bs, max(0, computed - i * bs))))
    for fills in shared.values():  # counted once per holder above; keep the fullest holder's
        a = [f[0] for f in fills]
        c = [f[1] for f in fills]
        assigned -= sum(a) - max(a)
        stored -= sum(c) - max(c)
    return stored, assigned, left
