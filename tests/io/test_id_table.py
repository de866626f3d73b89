"""io/id_table.py against a dict: random inserts, deletes and lookups, growth, compaction, and
probe chains forced by keys that share their hash."""
import random
import tracemalloc

import pytest

from pagedrun.io.id_table import DEAD, IdTable, MarkedKeys, digest, invalid_key, request_key


def keys(n: int, seed: int = 0) -> list[bytes]:
    return [digest(f"{seed}:{i}".encode()) for i in range(n)]


def check_equal(table: IdTable, ref: dict[bytes, tuple[int, int]]) -> None:
    """Same keys in the same (insertion) order, same values and marks, and every lookup agrees."""
    assert len(table) == len(ref)
    assert list(table) == list(ref)
    for k, (v, mark) in ref.items():
        e = table.find(k)
        assert e >= 0 and table.values[0][e] == v and table.marks[e] == mark


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_dict(seed):
    rng = random.Random(seed)
    pool = keys(600, seed)
    table, ref = IdTable(columns=1), {}
    for step in range(6000):
        k = rng.choice(pool)
        op = rng.random()
        if op < 0.5:
            e = table.add(k)
            table.values[0][e] = step
            ref[k] = (step, ref.get(k, (0, 0))[1])  # re-setting keeps the marks, as the place
        elif op < 0.6:
            e = table.add(k)
            table.marks[e] |= 3
            ref[k] = (ref.get(k, (0, 0))[0], 3)
        elif op < 0.8:
            assert table.discard(k) == (ref.pop(k, None) is not None)
        else:
            e = table.find(k)
            assert (e >= 0) == (k in ref) and (k in table) == (k in ref)
        if step % 1500 == 1499:
            table.compact()
        if step % 500 == 0:
            check_equal(table, ref)
    check_equal(table, ref)
    assert len(table) / table.num_slots <= 0.6


def test_it_grows_by_doubling_and_keeps_load_at_most_0_6():
    table = IdTable()
    sizes = []
    for i, k in enumerate(keys(5000)):
        table.add(k)
        if not sizes or table.num_slots != sizes[-1]:
            sizes.append(table.num_slots)
        assert len(table) <= 0.6 * table.num_slots
    assert sizes == [8 * 2**i for i in range(len(sizes))]
    assert 0.15 < len(table) / table.num_slots <= 0.6
    assert all(k in table for k in keys(5000)) and not any(k in table for k in keys(100, seed=1))


def test_deleted_entries_are_dropped_at_compact_and_room_is_reused():
    table = IdTable(columns=2)
    ks = keys(1000)
    for i, k in enumerate(ks):
        e = table.add(k)
        table.values[0][e], table.values[1][e] = i, 2**64 - 1 - i  # the whole unsigned 64-bit range
    for k in ks[::2]:
        table.discard(k)
    assert len(table.marks) == 1000 and len(table) == 500  # deleted, not yet dropped
    table.compact()
    assert len(table.marks) == 500 and list(table) == ks[1::2]
    for e, k in enumerate(ks[1::2]):
        i = 2 * e + 1
        assert table.find(k) == e and (table.values[0][e], table.values[1][e]) == (i, 2**64 - 1 - i)
    assert table.num_slots <= 2048


def collide(n: int, prefix: bytes = b"\x05" * 8) -> list[bytes]:
    """n keys with one hash (the first 8 bytes): every one probes from the same slot."""
    return [prefix + i.to_bytes(8, "little") for i in range(n)]


def test_forced_collisions_in_a_tiny_table():
    table = IdTable(columns=1, slots=8)
    same = collide(4)
    for i, k in enumerate(same):
        table.values[0][table.add(k)] = i
    assert table.num_slots == 8  # 4 of 8 slots: no growth, one chain of 4
    assert b"\x05" * 8 + b"\xff" * 8 not in table  # same hash, absent: the chain's end is found
    # Deleting from the middle of a chain leaves a tombstone: the keys past it are still found.
    assert table.discard(same[1]) and not table.discard(same[1])
    assert same[1] not in table and all(table.values[0][table.find(k)] == i for i, k in enumerate(same) if i != 1)
    # A key re-added after a delete is a new entry, at the end of the order (here the 5th entry
    # passes 0.6 of 8 slots: the table grows, dropping the deleted one).
    table.values[0][table.add(same[1])] = 9
    assert list(table) == [same[0], same[2], same[3], same[1]] and table.values[0][table.find(same[1])] == 9
    assert table.num_slots == 16 and len(table.marks) == 4


def test_a_probe_chain_wraps_around_the_end_of_the_index():
    table = IdTable(slots=8)
    wrap = collide(3, prefix=(7).to_bytes(8, "little"))  # slots 7, 0, 1
    zero = collide(1, prefix=(8).to_bytes(8, "little"))  # hashes to slot 0: probes past 0 and 1
    for k in wrap + zero:
        table.add(k)
    assert table.num_slots == 8 and all(k in table for k in wrap + zero)
    assert table.discard(wrap[0]) and all(k in table for k in wrap[1:] + zero) and wrap[0] not in table


def test_keys_must_be_16_bytes_and_slots_a_power_of_two():
    with pytest.raises(ValueError):
        IdTable().add(b"short")
    with pytest.raises(ValueError):
        IdTable(slots=12)


def test_marked_keys_read_like_a_set():
    table = IdTable()
    ks = keys(10)
    for k in ks:
        table.add(k)
    failed = MarkedKeys(table, 1)
    for k in ks[2:5]:
        table.marks[table.find(k)] |= 1
    table.discard(ks[3])
    assert len(failed) == 2 and set(failed) == {ks[2], ks[4]} and ks[3] not in failed and ks[5] not in failed
    with pytest.raises(ValueError):
        MarkedKeys(table, DEAD)


def test_request_keys_are_16_bytes_and_distinct():
    batch = "batch_req_" + "0123456789abcdef" * 2
    assert request_key(batch) == bytes.fromhex("0123456789abcdef" * 2)  # a Batch id: its own 16 bytes
    ids = ["7", 7, "a", "\ud800", "batch_req_" + "G" * 32, batch.upper()]
    got = [request_key(i) for i in ids] + [invalid_key(7), invalid_key("7")]
    assert all(len(k) == 16 for k in got)
    assert got[0] == got[1] and got[-1] == got[-2]  # an id is text; a line a number
    assert len({got[0], *got[2:-1]}) == len(got) - 2  # the id "7" is not line 7


def test_no_python_object_per_entry():
    """What an entry costs, traced: its bytes in the arrays, none of them objects (~40 + index)."""
    ks = keys(30_000)
    tracemalloc.start()
    try:
        table = IdTable(columns=3)
        base = tracemalloc.get_traced_memory()[0]
        for k in ks:
            table.add(k)
        per_entry = (tracemalloc.get_traced_memory()[0] - base) / len(ks)
    finally:
        tracemalloc.stop()
    assert per_entry <= 60, per_entry  # 16 + 24 + 1 + 4-byte slots at 0.3-0.6 load
