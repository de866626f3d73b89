"""A table of 16-byte ids with no Python object per id: what a job keeps per request (issue 40).

A dict of a million ids holds a million key objects (49 bytes for 16 bytes, 60-90 for a short
str) and a value object each, scattered among the arenas of each request's short-lived objects,
which pymalloc then cannot give back (docs/log/2026-11-28-memory-per-request.md). Here an entry is
16 bytes in one bytearray, its values 8 bytes each in array('Q') columns and one byte of marks:
none of them objects. An id that is not 16 bytes already becomes its BLAKE2b-128 digest
(`digest`): two different ids share one with probability ~n^2 / 2^129, nothing at any job's size.

The layout is CPython's compact dict: entries in insertion order (dense arrays), and a separate
index of 4-byte slots, open addressing with linear probing (a digest is uniform, so its first 8
bytes are the hash), doubled when live + deleted entries pass 0.6 of the slots. A deleted entry
stays in the dense arrays (marked DEAD) until the next growth or `compact()`, so iteration keeps
insertion order, as a dict's does, and re-setting a key keeps its place.
"""
from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Iterator

KEY_BYTES = 16
DEAD = 0x80  # the mark bit of a deleted entry; the other 7 bits are the owner's
_EMPTY = -1
_MIN_SLOTS = 8
_MAX_LOAD = 0.6
_BATCH_ID = re.compile(r"batch_req_[0-9a-f]{32}")


def digest(data: bytes) -> bytes:
    """An id's 16-byte key: BLAKE2b-128 of its bytes."""
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


class IdTable:
    """16-byte keys -> `columns` unsigned 64-bit values and 7 bits of marks, in insertion order.

    `find(key)` gives an entry's number (or -1), `add(key)` finds or appends one; the values are
    `values[c][entry]` and the marks `marks[entry]` (the same array and bytearray objects for the
    table's life). Entry numbers hold until the table grows or is compacted (any `add` may grow it):
    keep keys, not numbers, across an add."""

    def __init__(self, columns: int = 0, slots: int = _MIN_SLOTS) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        self._keys = bytearray()  # entry i's key: [16 i, 16 i + 16)
        self.values = [array("Q") for _ in range(columns)]
        self.marks = bytearray()
        self._index = array("i", [_EMPTY]) * slots  # entry number, or _EMPTY (never used)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, key: bytes) -> bool:
        return self.find(key) >= 0

    @property
    def num_slots(self) -> int:
        return len(self._index)

    def _check(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {len(key)}")

    def _probe(self, key: bytes) -> tuple[int, int]:
        """(entry number or -1, the slot where the key is or would go)."""
        index, keys, mask = self._index, self._keys, len(self._index) - 1
        slot = int.from_bytes(key[:8], "little") & mask
        while True:
            e = index[slot]
            if e == _EMPTY:
                return -1, slot
            # A deleted entry's slot still points at it (a tombstone): probing goes on past it.
            if keys[e * KEY_BYTES:(e + 1) * KEY_BYTES] == key and not self.marks[e] & DEAD:
                return e, slot
            slot = (slot + 1) & mask

    def find(self, key: bytes) -> int:
        """The entry number of `key`, or -1."""
        self._check(key)
        return self._probe(key)[0]

    def add(self, key: bytes) -> int:
        """The entry of `key`, appended (values 0, marks 0) if it is not in the table."""
        self._check(key)
        e, slot = self._probe(key)
        if e >= 0:
            return e
        used = len(self.marks)  # live and dead entries: each holds a slot
        if used + 1 > _MAX_LOAD * len(self._index):
            self._rebuild()
            e, slot = self._probe(key)
            used = len(self.marks)
        self._index[slot] = used
        self._keys += key
        for col in self.values:
            col.append(0)
        self.marks.append(0)
        self._live += 1
        return used

    def discard(self, key: bytes) -> bool:
        """Delete `key`'s entry; False if there was none."""
        e = self.find(key)
        if e < 0:
            return False
        self.marks[e] = DEAD
        self._live -= 1
        return True

    def key_at(self, e: int) -> bytes:
        return bytes(self._keys[e * KEY_BYTES:(e + 1) * KEY_BYTES])

    def entries(self) -> Iterator[int]:
        """The live entry numbers in insertion order (do not add while iterating)."""
        marks = self.marks
        return (e for e in range(len(marks)) if not marks[e] & DEAD)

    def __iter__(self) -> Iterator[bytes]:
        """The keys in insertion order."""
        return (self.key_at(e) for e in self.entries())

    def compact(self) -> None:
        """Drop deleted entries (renumbering the others) and size the index to what is left."""
        if self._live < len(self.marks):
            self._rebuild()

    def _rebuild(self) -> None:
        marks = self.marks
        if self._live < len(marks):  # an array of entry numbers, not a list: 8 bytes each
            live = array("q", (e for e in range(len(marks)) if not marks[e] & DEAD))
            # In place: a caller's reference to a column or to the marks stays valid.
            self._keys[:] = bytearray().join(self._keys[e * KEY_BYTES:(e + 1) * KEY_BYTES] for e in live)
            for col in self.values:
                col[:] = array("Q", (col[e] for e in live))
            marks[:] = bytearray(marks[e] for e in live)
            del live
        # Sized for twice the live entries (load <= 0.3 after): a growth doubles the slots.
        slots = _MIN_SLOTS
        while slots * _MAX_LOAD < 2 * self._live:
            slots *= 2
        self._index = array("i", [_EMPTY]) * slots
        index, keys, mask = self._index, self._keys, slots - 1
        for e in range(self._live):
            slot = int.from_bytes(keys[e * KEY_BYTES:e * KEY_BYTES + 8], "little") & mask
            while index[slot] != _EMPTY:
                slot = (slot + 1) & mask
            index[slot] = e


class MarkedKeys:
    """The keys of `table` whose entries carry the mark `bit`, read like a set (len, in, iteration);
    len counts the marks (a scan: read once per job, by its exit code)."""

    def __init__(self, table: IdTable, bit: int) -> None:
        if not 0 < bit < DEAD:
            raise ValueError(f"a mark is a bit below {DEAD:#x}, got {bit:#x}")
        self.table, self.bit = table, bit

    def __len__(self) -> int:
        bit = self.bit | DEAD
        return sum(1 for m in self.table.marks if m & bit == self.bit)

    def __contains__(self, key: bytes) -> bool:
        e = self.table.find(key)
        return e >= 0 and bool(self.table.marks[e] & self.bit)

    def __iter__(self) -> Iterator[bytes]:
        t = self.table
        return (t.key_at(e) for e in t.entries() if t.marks[e] & self.bit)


def request_key(request_id: object) -> bytes:
    """A request's key: for a Batch API id (batch_req_ + 32 hex digits, io/openai_batch.py) those
    digits' 16 bytes, already a hash; for any other id the digest of its text."""
    request_id = str(request_id)
    if len(request_id) == 42 and _BATCH_ID.fullmatch(request_id):
        return bytes.fromhex(request_id[10:])
    # surrogatepass: a JSON id may hold a lone surrogate ("\ud800"), which strict UTF-8 refuses.
    return digest(b"id:" + request_id.encode("utf-8", "surrogatepass"))


def invalid_key(line: int) -> bytes:
    """The key of an error record for an input line that could not run: by its line number (another
    prefix than an id's, so the id "7" and line 7 are two keys)."""
    return digest(b"line:%d" % int(line))
