"""The KV occupancy the report reads after every step (metrics.StepRecord): what the running
sequences hold in the paged cache, and what a contiguous cache would reserve for them."""
from __future__ import annotations


def occupancy(running, kv, max_model_len: int) -> dict:
    """Slots holding computed KV and slots assigned to tokens, each distinct block counted once
    (forked children and prefix hits share blocks), tokens held per sequence, and the contiguous
    reservation the same sequences would need (the report's what-if; computed, not allocated).

    Per sequence the unshared blocks hold exactly its computed / assigned tokens; only shared
    blocks (a leading run of each table, KVCacheManager.shared_prefix_blocks) need the
    per-block max over their holders (KVCacheManager.held_slots). So the cost per step is the
    number of running sequences plus shared blocks, not every block of every table.

    With KV cache groups (kv/hybrid.py) slots are counted in every group (a block of each holds
    its own layers' K/V), from the first position the group still holds: a sliding group's table
    starts with the entries its window gave back (blocks_left_window counts them)."""
    logical = reserved = 0
    held: list[tuple[int, int]] = []  # (seq_id, tokens computed) of every running sequence
    for g in running:
        want = min(g.prompt_len + g.sampling.max_tokens, max_model_len)
        for seq in g.unfinished_seqs():
            computed = seq.num_computed_tokens
            logical += computed
            reserved += want
            held.append((seq.seq_id, computed))
    stored = assigned = left = 0
    for manager in getattr(kv, "managers", (kv,)):
        s, a, n = manager.held_slots(held)
        stored, assigned, left = stored + s, assigned + a, left + n
    return {"tokens_stored": stored, "tokens_assigned": assigned,
            "tokens_logical": logical, "reserved_contiguous_tokens": reserved,
            "num_running_requests": len(running), "blocks_left_window": left}
