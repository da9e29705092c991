"""The NVMe tier's persistent index (LMDB), and rebuilding the slot allocator from it at start.

One LMDB environment in ``<dir>/index``: database ``blocks`` maps a 32-byte block key to a
packed :class:`BlockRecord`; database ``meta`` holds the geometry the data files were laid out
with. A record is committed only after its data is on the device, so every record names bytes
that were completely written (the checksums decide whether they still are).

Raises ``lmdb.Error`` subclasses; the tier turns them into tier errors.
Thread-safety: LMDB serialises writers itself; read transactions may run on any thread.
"""

from __future__ import annotations

import json
import os
import struct
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator

import lmdb

from kvstore.tiers.base import ExtentAllocator
from kvstore.tiers.nvme.files import PRIVATE_DIR, PRIVATE_FILE, private_dir, private_mode

RECORD_VERSION = 1   # a block stored raw (what every daemon before the codecs reads)
CODED_VERSION = 2    # a block stored encoded: _HEAD, then _CODED, then as version 1
# version, flags, ns length, chunk count, offset, slot_bytes, nbytes, chunk_bytes, atime, ctime
_HEAD = struct.Struct("<BBHIQQQQdd")
_CODED = struct.Struct("<BQ")  # codec (kvstore.codec.Codec), stored payload bytes
_HAS_PARENT = 1


@dataclass(slots=True)
class BlockRecord:
    """What the index knows about one committed block. Sizes in bytes, times in Unix seconds."""

    key: bytes
    ns_id: bytes
    parent: bytes | None
    offset: int          # byte offset in the tier's flat data space (file = offset // file_bytes)
    slot_bytes: int      # the allocator's slot size (>= the bytes stored)
    nbytes: int          # bytes of block data (raw, as the caller put and gets it)
    chunk_bytes: int     # bytes per checksummed chunk (one layer); 0 = whole block
    sums: array          # xxh3_64 per chunk of the raw bytes, array('Q')
    atime: float
    ctime: float
    codec: int = 0       # how the slot holds the block (kvstore.codec.Codec; 0 = raw)
    stored: int = 0      # bytes in the slot: the encoded payload's length (= nbytes when raw)

    def __post_init__(self) -> None:
        self.stored = self.stored or self.nbytes

    def pack(self) -> bytes:
        flags = _HAS_PARENT if self.parent is not None else 0
        coded = _CODED.pack(self.codec, self.stored) if self.codec else b""
        return b"".join((
            _HEAD.pack(CODED_VERSION if self.codec else RECORD_VERSION, flags, len(self.ns_id), len(self.sums),
                       self.offset, self.slot_bytes, self.nbytes, self.chunk_bytes, self.atime, self.ctime),
            coded, self.ns_id, self.parent or b"", self.sums.tobytes()))

    @classmethod
    def unpack(cls, key: bytes, raw: bytes) -> "BlockRecord":
        """Decode; raises ValueError on a record this version cannot read."""
        if len(raw) < _HEAD.size:
            raise ValueError("record too short")
        ver, flags, ns_len, n, offset, slot_bytes, nbytes, chunk, atime, ctime = _HEAD.unpack_from(raw)
        if ver not in (RECORD_VERSION, CODED_VERSION):
            raise ValueError(f"record version {ver}, expected {RECORD_VERSION} or {CODED_VERSION}")
        pos, codec, stored = _HEAD.size, 0, 0
        if ver == CODED_VERSION:
            if len(raw) < pos + _CODED.size:
                raise ValueError("record too short")
            codec, stored = _CODED.unpack_from(raw, pos)
            pos += _CODED.size
            if not codec or not 0 < stored < nbytes:
                raise ValueError(f"encoded record: codec {codec}, {stored} bytes stored for {nbytes}")
        ns_id = bytes(raw[pos:pos + ns_len])
        pos += ns_len
        parent = None
        if flags & _HAS_PARENT:
            parent = bytes(raw[pos:pos + 32])
            pos += 32
        sums = array("Q")
        sums.frombytes(raw[pos:pos + 8 * n])
        if len(ns_id) != ns_len or len(sums) != n or pos + 8 * n != len(raw):
            raise ValueError("record length does not match its header")
        return cls(bytes(key), ns_id, parent, offset, slot_bytes, nbytes, chunk, sums, atime, ctime, codec, stored)


class NvmeIndex:
    """LMDB environment holding block records and the data-file geometry."""

    def __init__(self, path: str, map_bytes: int, durable: bool) -> None:
        # sync/metasync off still survives a process crash (commits reach the page cache); only
        # a power loss can then lose the last commits.
        private_dir(path)
        self.env = lmdb.open(path, map_size=map_bytes, subdir=True, max_dbs=2, sync=durable,
                             metasync=durable, readahead=False, lock=True, mode=PRIVATE_DIR)
        for name in ("data.mdb", "lock.mdb"):  # LMDB makes them 0600 (mode less x); an older daemon's may be looser
            private_mode(os.path.join(path, name), PRIVATE_FILE)
        self.blocks = self.env.open_db(b"blocks")
        self.meta = self.env.open_db(b"meta")

    def geometry(self, wanted: dict) -> dict:
        """The geometry the stored blocks were laid out with. Stores ``wanted`` while the index
        holds no block (a fresh directory, or one whose first open failed)."""
        with self.env.begin(db=self.meta) as txn:
            raw = txn.get(b"geometry")
        try:
            have = None if raw is None else json.loads(raw)
        except ValueError as e:  # damaged: laid out with what, nobody can tell
            have = f"a geometry record that does not parse ({e})"
        if have != wanted and (have is None or self.count() == 0):
            with self.env.begin(write=True, db=self.meta) as txn:
                txn.put(b"geometry", json.dumps(wanted, sort_keys=True).encode())
            return wanted
        return have

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(key, raw record)``; one read transaction for the whole scan."""
        with self.env.begin(db=self.blocks, buffers=False) as txn:
            yield from txn.cursor()

    def get(self, keys: Iterable[bytes]) -> list[BlockRecord | None]:
        out = []
        with self.env.begin(db=self.blocks, buffers=False) as txn:
            for k in keys:
                raw = txn.get(k)
                out.append(None if raw is None else BlockRecord.unpack(k, raw))
        return out

    def commit(self, records: Iterable[BlockRecord], atimes: dict[bytes, float]) -> None:
        """Insert ``records`` and update access times, in one transaction."""
        with self.env.begin(write=True, db=self.blocks) as txn:
            for rec in records:
                txn.put(rec.key, rec.pack())
            for key, t in atimes.items():
                raw = txn.get(key)
                if raw is not None:  # deleted since it was touched
                    rec = BlockRecord.unpack(key, raw)
                    rec.atime = t
                    txn.put(key, rec.pack())

    def has(self, keys: Iterable[bytes]) -> list[bool]:
        """Per key: a record is committed."""
        with self.env.begin(db=self.blocks) as txn:
            return [txn.get(k) is not None for k in keys]

    def delete(self, keys: Iterable[bytes], offsets: dict[bytes, int] | None = None) -> dict[bytes, BlockRecord]:
        """Delete the records of ``keys``, in one transaction; with ``offsets``, only those whose
        record still names that slot. Returns ``key -> record`` of the records deleted."""
        gone = {}
        with self.env.begin(write=True, db=self.blocks) as txn:
            for k in keys:
                raw = txn.get(k)
                if raw is None:
                    continue
                rec = BlockRecord.unpack(k, raw)
                if offsets is None or offsets[k] == rec.offset:
                    txn.delete(k)
                    gone[k] = rec
        return gone

    def count(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.blocks)["entries"]

    def close(self) -> None:
        self.env.close()


def recover(index: NvmeIndex, alloc: ExtentAllocator) -> tuple[list[BlockRecord], int]:
    """Rebuild ``alloc``'s free space from every record in ``index``.

    Returns ``(records kept, records dropped)``. A record is dropped (deleted from the index)
    when it is unreadable, its sizes disagree, or its slot cannot be claimed (outside the data
    files, misaligned, in another namespace's extent, or claimed by another record). Data bytes
    are not read here: every read verifies them.
    """
    keep: list[BlockRecord] = []
    bad: list[bytes] = []
    for key, raw in index.scan():
        try:
            r = BlockRecord.unpack(key, raw)
            n_chunks = -(-r.nbytes // r.chunk_bytes) if r.chunk_bytes else 1
            if len(key) != 32 or not 0 < r.stored <= r.slot_bytes or len(r.sums) != n_chunks:
                raise ValueError("inconsistent sizes")
        except ValueError:
            bad.append(key)
            continue
        keep.append(r)
    refused = set(alloc.restore((r.ns_id, r.slot_bytes, r.offset) for r in keep))
    bad += [r.key for i, r in enumerate(keep) if i in refused]
    if bad:
        index.delete(bad)
    return [r for i, r in enumerate(keep) if i not in refused], len(bad)
