"""NVMe tier: the shared tier contract, the key-level API, restart and corruption recovery.
Real files, real LMDB. Crash and failure modes: test_nvme_failures.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.daemon.metrics import Metrics
from kvstore.tiers.arena import Arena
from kvstore.tiers.base import TierError
from kvstore.tiers.nvme import IoMode, IoResult, NvmeBatchError, NvmeChecksumError, NvmeTier, NvmeTierConfig
from tier_contract import TierContract
from nvme_util import BLOCK, CHUNK, NS, NS2, KiB, MiB, cfg, data, get, key, put, race_reads_with_churn
from wait_util import wait_for


@pytest.fixture
def tier(tmp_path):
    with NvmeTier(cfg(tmp_path / "nvme")) as t:
        yield t


# --- the shared contract ----------------------------------------------------------------------

class TestNvmeContract(TierContract):
    def make_tier(self, tmp_path, capacity_bytes):
        return NvmeTier(NvmeTierConfig(dir=str(tmp_path / "contract"), capacity_bytes=capacity_bytes,
                                   file_bytes=capacity_bytes // 2, extent_bytes=4 * self.SLOT, io_threads=4,
                                   bounce_bytes=64 * KiB))


class TestNvmeContractBuffered(TestNvmeContract):
    """The same contract when the filesystem refuses O_DIRECT (page cache + fdatasync)."""

    def make_tier(self, tmp_path, capacity_bytes):
        t = NvmeTier(NvmeTierConfig(dir=str(tmp_path / "contract"), capacity_bytes=capacity_bytes,
                                file_bytes=capacity_bytes, extent_bytes=4 * self.SLOT, io_mode=IoMode.BUFFERED))
        assert t.stats().extra["io_mode"] == "buffered"
        return t


# --- key-level API ------------------------------------------------------------------------------

def test_put_get_round_trip_from_arena(tmp_path):
    metrics = Metrics()
    arena = Arena(16 * BLOCK)
    for i in range(8):
        arena.view(i * BLOCK, BLOCK)[:] = data(i)
    with NvmeTier(cfg(tmp_path / "nvme"), metrics=metrics) as t:
        assert t.io_mode is IoMode.DIRECT
        b = t.put_many([(NS, key(i), None, CHUNK, arena.view(i * BLOCK, BLOCK)) for i in range(8)])
        b.result(30)
        assert [b.results[key(i)] for i in range(8)] == [IoResult.OK] * 8
        assert b.nbytes == 8 * BLOCK and b.error is None
        g = t.get_many([key(i) for i in range(8)], [arena.view((8 + i) * BLOCK, BLOCK) for i in range(8)])
        g.result(30)
        assert np.array_equal(arena.buf[8 * BLOCK:], arena.buf[:8 * BLOCK])
        st = t.stats()
        assert (st.used_bytes, st.blocks, st.extra["indexed_blocks"]) == (8 * BLOCK, 8, 8)
        assert st.extra["bounced_ios"] == 0  # page-aligned arena views go straight to the file
        assert t.contains([key(0), key(99)]) == [True, False]
    val = metrics.registry.get_sample_value
    assert val("kvstore_nvme_io_bytes_total", {"op": "write"}) == 8 * BLOCK
    assert val("kvstore_nvme_io_bytes_total", {"op": "read"}) == 8 * BLOCK
    assert val("kvstore_nvme_io_ops_total", {"op": "write"}) == 8
    assert val("kvstore_nvme_io_ops_total", {"op": "read"}) == 8
    assert val("kvstore_checksum_failures_total", {"source": "nvme"}) == 0
    arena.close()


def test_unaligned_and_odd_sized_blocks(tier):
    n = 3 * 4096 + 1234  # e.g. an MLA layout: blocks are not a multiple of 4 KiB
    raw = bytearray(n + 1)
    raw[1:] = data(1, n).tobytes()
    tier.put_many([(NS, key(1), None, 1000, memoryview(raw)[1:])]).result(30)
    out = bytearray(n + 7)
    g = tier.get_many([key(1)], [memoryview(out)[7:]])
    g.result(30)
    assert out[7:] == raw[1:]
    assert tier.stats().extra["bounced_ios"] == 2


@pytest.mark.parametrize("aligned", [True, False])
def test_destination_larger_than_the_block(tier, aligned):
    """A DRAM slot may be larger than the block; the bytes past the block are not the block's."""
    n = 3 * 4096 + 1234  # the last 1000-byte chunk is short
    tier.put_many([(NS, key(1), None, 1000, data(1, n))]).result(30)
    arena = Arena(8 * 4096)
    dst = arena.view(0 if aligned else 1, 6 * 4096)
    dst[:] = 0xEE
    tier.get_many([key(1)], [dst]).result(30)
    assert np.array_equal(dst[:n], data(1, n))
    arena.close()


def test_adjacent_blocks_move_in_vectored_ios_and_fail_alone(tmp_path):
    c = cfg(tmp_path / "nvme", coalesce_bytes=256 * KiB)
    arena = Arena(32 * BLOCK)
    for i in range(16):
        arena.view(i * BLOCK, BLOCK)[:] = data(i)
    with NvmeTier(c) as t:
        t.put_many([(NS, key(i), None, CHUNK, arena.view(i * BLOCK, BLOCK)) for i in range(16)]).result(30)
        st = t.stats().extra
        assert (st["writes"], st["written_bytes"], st["bounced_ios"]) == (16, 16 * BLOCK, 0)
        assert st["vectored_ios"] == 4  # 16 adjacent 64 KiB slots in runs of 256 KiB
        slots = {e.key: e.slot for e in t.entries()}
        flip_byte(c, slots[key(6)] + 5 * CHUNK)  # inside the second run
        g = t.get_many([key(i) for i in range(16)], [arena.view((16 + i) * BLOCK, BLOCK) for i in range(16)])
        assert g.wait(30)
        assert g.results[key(6)] is IoResult.CORRUPT and g.errors[key(6)].chunk == 5
        for i in set(range(16)) - {6}:
            assert g.results[key(i)] is IoResult.OK
            assert np.array_equal(arena.view((16 + i) * BLOCK, BLOCK), data(i)), f"block {i}"
        assert t.stats().extra["vectored_ios"] == 8
    arena.close()


def test_present_and_in_batch_duplicates_write_nothing(tier):
    put(tier, range(3)).result()
    writes = tier.stats().extra["writes"]
    b = put(tier, [0, 1, 2, 3, 3])
    assert [b.results[key(i)] for i in range(4)] == [IoResult.PRESENT] * 3 + [IoResult.OK]
    assert b.error is None
    assert tier.stats().extra["writes"] == writes + 1


def test_full_tier_is_back_pressure_not_an_exception(tier):
    cap = 4 * MiB // BLOCK
    assert tier.room(NS, BLOCK) == cap
    put(tier, range(cap)).result()
    assert tier.room(NS, BLOCK) == 0
    b = tier.put_many([(NS, key(cap), None, CHUNK, data(cap))])
    assert b.results[key(cap)] is IoResult.NO_SPACE  # known when put_many returns
    assert b.wait(30) and isinstance(b.error, NvmeBatchError)
    assert tier.stats().enabled
    assert tier.delete([key(0)]) == 1
    assert tier.room(NS, BLOCK) == 1
    put(tier, [cap]).result()
    assert tier.stats().used_bytes == 4 * MiB


def test_get_missing_is_a_normal_answer(tier):
    put(tier, [0]).result()
    dst = np.full(BLOCK, 7, np.uint8)
    b = tier.get_many([key(5), key(0)], [dst, np.zeros(BLOCK, np.uint8)])
    assert b.results[key(5)] is IoResult.MISSING
    assert b.wait(30) and b.results[key(0)] is IoResult.OK
    assert isinstance(b.error, NvmeBatchError) and b.ok_keys() == [key(0)]
    assert (dst == 7).all()  # untouched


def test_bad_input_is_refused_before_anything_happens(tier):
    with pytest.raises(ValueError):
        tier.put_many([(NS, b"short", None, 0, data(0))])
    with pytest.raises(ValueError):
        tier.put_many([(NS, key(0), None, -1, data(0))])
    with pytest.raises(ValueError):
        tier.put_many([(NS, key(0), None, 0, np.zeros(0, np.uint8))])
    with pytest.raises(ValueError):
        tier.put_many([(NS, key(0), None, 0, np.zeros(1 * MiB, np.uint8))])  # larger than an extent
    assert tier.stats().used_bytes == 0
    put(tier, [0]).result()
    with pytest.raises(ValueError):
        tier.get_many([key(0)], [np.zeros(BLOCK - 1, np.uint8)])
    with pytest.raises(ValueError):
        tier.get_many([key(0), key(0)], [np.zeros(BLOCK, np.uint8)] * 2)
    with pytest.raises(ValueError):
        tier.get_many([key(0)], [bytes(BLOCK)])  # read-only destination
    g, dsts = get(tier, [0])  # pins were released: the block reads and deletes normally
    assert g.error is None and tier.delete([key(0)]) == 1 and tier.stats().used_bytes == 0


def test_delete_frees_and_persists(tmp_path):
    c = cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, range(4)).result()
        assert t.delete([key(1), key(3), key(9)]) == 2
        assert t.contains([key(i) for i in range(4)]) == [True, False, True, False]
        assert (t.stats().used_bytes, t.stats().blocks) == (2 * BLOCK, 2)
    with NvmeTier(c) as t:
        assert sorted(e.key for e in t.entries()) == sorted([key(0), key(2)])
        assert t.stats().used_bytes == 2 * BLOCK


def test_delete_racing_put_leaves_nothing_behind(tier):
    for round_ in range(5):
        ids = range(round_ * 8, round_ * 8 + 8)
        b = tier.put_many([(NS, key(i), None, CHUNK, data(i)) for i in ids])
        tier.delete([key(i) for i in ids])  # some still in flight (CANCELLED), some committed
        assert b.wait(30) and b.error is None
        assert set(b.results.values()) <= {IoResult.OK, IoResult.CANCELLED}
        assert tier.contains([key(i) for i in ids]) == [False] * 8
        assert (tier.stats().used_bytes, tier.stats().blocks) == (0, 0)


def test_delete_during_read_defers_the_free(tier):
    put(tier, range(16)).result()
    dsts = [np.zeros(BLOCK, np.uint8) for _ in range(16)]
    g = tier.get_many([key(i) for i in range(16)], dsts)
    tier.delete([key(i) for i in range(16)])
    assert g.wait(30) and g.error is None  # pinned before the delete: every read completes
    assert all(np.array_equal(d, data(i)) for i, d in enumerate(dsts))
    assert (tier.stats().used_bytes, tier.stats().blocks) == (0, 0)


def test_on_done_runs_once_per_batch_on_a_tier_thread(tier):
    import threading
    seen = []
    me = threading.get_ident()

    def done(batch):
        seen.append((batch, threading.get_ident() != me))

    b = tier.put_many([(NS, key(i), None, CHUNK, data(i)) for i in range(4)], on_done=done)
    b.result(30)
    g = tier.get_many([key(0)], [np.zeros(BLOCK, np.uint8)], on_done=done)
    g.result(30)
    m = tier.get_many([key(99)], [np.zeros(BLOCK, np.uint8)], on_done=done)  # nothing to read
    p = tier.put_many([(NS, key(0), None, CHUNK, data(0))], on_done=done)  # nothing to write
    assert m.wait(30) and p.wait(30)
    wait_for(lambda: len(seen) == 4, 30, "on_done of each batch")  # it runs just after the batch is done
    assert sorted(map(id, (x for x, _ in seen))) == sorted(map(id, (b, g, m, p)))
    assert all(other_thread for _, other_thread in seen)


def test_recorded_sums_are_stored_as_given_and_reported_back(tier):
    from kvstore.tiers.nvme.files import chunk_sums
    good = chunk_sums(data(0), BLOCK, CHUNK)
    b = tier.put_many([(NS, key(0), None, CHUNK, data(0), list(good)),
                       (NS, key(1), key(0), CHUNK, data(1))])
    assert b.wait(30) and b.error is None
    assert b.digests() == {key(0): good, key(1): chunk_sums(data(1), BLOCK, CHUNK)}
    g, dsts = get(tier, [0, 1])
    assert g.error is None and (dsts[0] == data(0)).all()
    assert g.digests()[key(0)] == good  # read back and verified
    # Sums recorded before the bytes changed are kept as given: the block reads back as
    # corrupt (and is dropped) instead of being served under a checksum of the changed bytes.
    stale = list(chunk_sums(data(2), BLOCK, CHUNK))
    changed = data(2).copy()
    changed[3 * CHUNK + 5] ^= 1
    assert tier.put_many([(NS, key(2), None, CHUNK, changed, stale)]).wait(30)
    g, _ = get(tier, [2])
    assert g.results[key(2)] is IoResult.CORRUPT and key(2) not in g.digests()
    with pytest.raises(ValueError, match="sums"):
        tier.put_many([(NS, key(3), None, CHUNK, data(3), stale[:-1])])


# --- restart ----------------------------------------------------------------------------------

class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_restart_recovers_every_block_and_the_free_space(tmp_path):
    c = cfg(tmp_path / "nvme", capacity_bytes=8 * MiB, file_bytes=4 * MiB)
    clock = FakeClock(1000.0)
    with NvmeTier(c, clock=clock) as t:
        put(t, range(10)).result()
        put(t, range(5), ns=NS2, nbytes=3 * BLOCK + 100, chunk=0).result()
        clock.t = 2000.0
        t.touch([key(3)])
        g, _ = get(t, [4])  # a read is an access too
        used = t.stats().used_bytes
    with NvmeTier(c) as t:
        assert t.recovery.blocks == 15 and t.recovery.dropped == 0
        assert t.stats().used_bytes == used
        got = {e.key: e for e in t.entries()}
        assert set(got) == {key(i) for i in range(10)} | {key(i, NS2) for i in range(5)}
        e = got[key(3)]
        assert (e.ns_id, e.parent, e.nbytes, e.chunk_bytes, e.ctime, e.atime) == (NS, key(2), BLOCK, CHUNK, 1000.0, 2000.0)
        assert got[key(4)].atime == 2000.0 and got[key(5)].atime == 1000.0
        e2 = got[key(0, NS2)]
        assert (e2.ns_id, e2.parent, e2.nbytes, e2.chunk_bytes) == (NS2, None, 3 * BLOCK + 100, 0)
        # New blocks after the restart never land on recovered ones.
        put(t, range(10, 40)).result()
        g, dsts = get(t, range(40))
        assert g.error is None and all(np.array_equal(d, data(i)) for i, d in enumerate(dsts))
        g, dsts = get(t, range(5), ns=NS2, nbytes=3 * BLOCK + 100)
        assert g.error is None and all(np.array_equal(d, data(i, 3 * BLOCK + 100)) for i, d in enumerate(dsts))


def test_torn_write_is_never_served(tmp_path):
    """Data in a slot with no index record (a put that died before its commit) is free space."""
    c = cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, [0]).result()
        (entry,) = t.entries()
    write_at(c, entry.slot + BLOCK, data(1))  # the next free slot: bytes on disk, never committed
    with NvmeTier(c) as t:
        assert [e.key for e in t.entries()] == [key(0)]
        assert (t.stats().used_bytes, t.stats().blocks) == (BLOCK, 1)
        g, _ = get(t, [1])
        assert g.results[key(1)] is IoResult.MISSING


def write_at(c: NvmeTierConfig, offset: int, buf: np.ndarray) -> None:
    """Write ``buf`` into the data files at tier data offset ``offset``, behind the tier's back."""
    fd = os.open(os.path.join(c.dir, f"data-{offset // c.file_bytes:05d}.kvd"), os.O_WRONLY)
    try:
        os.pwrite(fd, buf.tobytes(), offset % c.file_bytes)
    finally:
        os.close(fd)


def flip_byte(c: NvmeTierConfig, offset: int) -> None:
    path = os.path.join(c.dir, f"data-{offset // c.file_bytes:05d}.kvd")
    with open(path, "r+b") as f:
        f.seek(offset % c.file_bytes)
        b = f.read(1)
        f.seek(offset % c.file_bytes)
        f.write(bytes([b[0] ^ 0x01]))


def test_flipped_byte_is_detected_counted_and_dropped(tmp_path):
    c = cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, range(4)).result()
        slot = {e.key: e.slot for e in t.entries()}[key(2)]
    flip_byte(c, slot + 3 * CHUNK + 17)
    metrics = Metrics()
    with NvmeTier(c, metrics=metrics) as t:
        assert t.recovery.blocks == 4  # recovery trusts the index; the read checks the bytes
        g, dsts = get(t, range(4))
        assert g.results[key(2)] is IoResult.CORRUPT
        err = g.errors[key(2)]
        assert isinstance(err, NvmeChecksumError) and isinstance(err, TierError)
        assert (err.key, err.chunk, err.offset) == (key(2), 3, slot)
        assert "layer chunk 3 of 8" in str(err)
        assert isinstance(g.error, NvmeBatchError)
        assert all(g.results[key(i)] is IoResult.OK and np.array_equal(dsts[i], data(i)) for i in (0, 1, 3))
        assert t.contains([key(2)]) == [False]
        st = t.stats()
        assert (st.used_bytes, st.blocks, st.extra["checksum_failures"], st.enabled) == (3 * BLOCK, 3, 1, True)
        assert metrics.registry.get_sample_value("kvstore_checksum_failures_total", {"source": "nvme"}) == 1
        g, _ = get(t, [2])
        assert g.results[key(2)] is IoResult.MISSING  # dropped for good
    with NvmeTier(c) as t:
        assert sorted(e.key for e in t.entries()) == sorted(key(i) for i in (0, 1, 3))


def test_scrub_finds_corruption_under_an_open_tier(tier):
    put(tier, range(6)).result()
    slots = {e.key: e.slot for e in tier.entries()}
    flip_byte(tier.config, slots[key(1)])
    flip_byte(tier.config, slots[key(4)] + BLOCK - 1)
    assert tier.scrub() == 2
    assert tier.contains([key(i) for i in range(6)]) == [True, False, True, True, False, True]
    assert tier.scrub() == 0


def test_reads_racing_deletes_and_puts_of_the_same_keys_never_see_another_block(tier):
    """The index is the only record of what is stored: a read that finds a block reads that
    block whole, even while another thread deletes it and stores other blocks in its slot."""
    ids = range(16)
    seen, bad = race_reads_with_churn(tier, ids, range(1000, 1008), put, get, data, readers=2, reads=2000)
    assert not bad and IoResult.OK in seen and tier.stats().extra["checksum_failures"] == 0
    assert all(tier.contains([key(i) for i in ids[1::2]]))  # never deleted: still there
