"""NVMe tier under failure: a SIGKILLed writer keeps every acknowledged block, and disk full,
unwritable directories, a full index, a busy directory, a geometry change and a filesystem
without O_DIRECT each end in a clear error or a clean fallback. Real files, real LMDB, real
mounts (tmpfs; those tests need root and skip without it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from kvstore.tiers.nvme import IoMode, IoResult, NvmeTier, NvmeTierConfig, SyncMode
from kvstore.tiers.nvme import (
    NvmeBusyError, NvmeDisabledError, NvmeDiskFullError, NvmeGeometryError, NvmeIndexFullError,
    NvmeIOError, NvmeUnwritableError)
from nvme_util import BLOCK, CHUNK, MiB, NS, KiB, cfg, data, get, key, put


# --- crash: SIGKILL during a heavy write stream ------------------------------------------------

CRASH_HELPERS = """
import hashlib
import numpy as np
B = 48 * 1024 + 4096            # 52 KiB: page-aligned lengths go direct, one in 4 odd ones bounce
BASE = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8)
NS = hashlib.sha256(b"crash").digest()
def nbytes(i): return B if i % 4 else B - 1000
def key(i): return hashlib.sha256(NS + i.to_bytes(8, "little")).digest()
def block(i):
    off = (i * 4096 * 7) % (BASE.nbytes - B)
    b = BASE[off:off + nbytes(i)].copy()
    b[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return b
"""
# Page-aligned sources, so adjacent full-page blocks go out in vectored writes.
ALIGNED = "\nfrom kvstore.tiers.nvme.files import aligned_buffer\n" + """
def aligned_block(i):
    b = aligned_buffer(nbytes(i))[:nbytes(i)]
    b[:] = block(i)
    return b
"""

CRASH_CHILD = CRASH_HELPERS + ALIGNED + """
import sys
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig, SyncMode
tier = NvmeTier(NvmeTierConfig(dir=sys.argv[1], capacity_bytes=256 << 20, file_bytes=64 << 20,
                               extent_bytes=1 << 20, io_threads=4, sync=SyncMode(sys.argv[2])))
out, inflight, i = sys.stdout, [], 0
while True:
    ids = list(range(i, i + 8))
    i += 8
    out.write("S " + " ".join(map(str, ids)) + "\\n")
    out.flush()
    inflight.append((tier.put_many([(NS, key(j), key(j - 1) if j else None, 4096, aligned_block(j))
                                    for j in ids]), ids))
    if len(inflight) == 4:
        b, done = inflight.pop(0)
        b.result(60)
        out.write("A " + " ".join(map(str, done)) + "\\n")
        out.flush()
"""


@pytest.mark.parametrize("sync,delay_s", [(SyncMode.DURABLE, 0.0), (SyncMode.DURABLE, 0.002),
                                          (SyncMode.PROCESS, 0.002)])
def test_sigkill_during_write_stream_keeps_every_acknowledged_block(tmp_path, sync, delay_s):
    d = str(tmp_path / "nvme")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, d, sync.value], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    submitted, acked = set(), set()
    try:
        for line in proc.stdout:
            kind, *ids = line.split()
            (acked if kind == b"A" else submitted).update(int(x) for x in ids)
            if len(acked) >= 400:
                time.sleep(delay_s)  # 0: right after an ack; later: anywhere in write/sync/commit
                proc.send_signal(signal.SIGKILL)  # mid-stream: 24 blocks are in flight
                break
        proc.wait(60)
        rest, err = proc.stdout.read(), proc.stderr.read()  # through the reader's buffer, to EOF
    finally:
        proc.kill()
    for line in rest.split(b"\n")[:-1]:  # acknowledged before the kill landed: just as binding
        kind, *ids = line.split()
        (acked if kind == b"A" else submitted).update(int(x) for x in ids)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert len(acked) >= 400 and submitted - acked, "the kill must land with puts in flight"

    ns = {}
    exec(CRASH_HELPERS + ALIGNED, ns)
    c = NvmeTierConfig(dir=d, capacity_bytes=256 << 20, file_bytes=64 << 20, extent_bytes=1 << 20, io_threads=4)
    with NvmeTier(c) as t:
        entries = {e.key: e for e in t.entries()}
        by_key = {ns["key"](i): i for i in submitted}
        assert set(entries) <= set(by_key), "the index names a block that was never submitted"
        assert {ns["key"](i) for i in acked} <= set(entries), "an acknowledged block was lost"
        assert t.stats().used_bytes == sum(-(-e.nbytes // 4096) * 4096 for e in entries.values())
        ids = sorted(by_key[k] for k in entries)
        dsts = [ns["aligned_buffer"](ns["nbytes"](i))[:ns["nbytes"](i)] for i in ids]
        g = t.get_many([ns["key"](i) for i in ids], dsts)
        g.result(60)  # every indexed block, acknowledged or not, reads back verified ...
        for i, dst in zip(ids, dsts):  # ... and bit-exact
            assert np.array_equal(dst, ns["block"](i)), f"block {i}"
        unacked = submitted - set(ids)
        g = t.get_many([ns["key"](i) for i in unacked], [np.zeros(ns["B"], np.uint8) for _ in unacked])
        g.wait(60)
        assert all(g.results[ns["key"](i)] is IoResult.MISSING for i in unacked)
        assert t.stats().extra["checksum_failures"] == 0
        st = t.stats().extra  # both read paths ran: vectored runs of full pages, and bounced tails
        assert st["vectored_ios"] > 0 and st["bounced_ios"] > 0


# --- failure modes ----------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(path, size: str, *opts: str, fstype: str = "tmpfs"):
    """A real tmpfs (or ``fstype``) of ``size`` at ``path``; needs root, skips the test otherwise."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a {fstype}")
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", fstype, "-o", ",".join((f"size={size}",) + opts), fstype, str(path)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount {fstype}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(path) -> None:
    """Use every remaining byte of the filesystem holding ``path``."""
    fd = os.open(os.path.join(path, f"filler-{uuid.uuid4().hex}"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\xff" * 4096):
                pass
    finally:
        os.close(fd)


def test_disk_full_at_create_is_a_clear_error(tmp_path):
    with tmpfs(tmp_path / "small", "2m") as mnt:
        with pytest.raises(NvmeDiskFullError, match="disk full"):
            NvmeTier(cfg(mnt / "nvme", capacity_bytes=4 * MiB))
        assert os.statvfs(mnt).f_bfree * os.statvfs(mnt).f_frsize > 1 * MiB  # nothing left allocated
        with NvmeTier(cfg(mnt / "nvme", capacity_bytes=1 * MiB)) as t:
            put(t, [0]).result()  # the same directory works once it fits


def test_disk_full_on_data_write_disables_the_tier(tmp_path):
    with tmpfs(tmp_path / "small", "2m") as mnt:
        c = cfg(mnt / "nvme", capacity_bytes=8 * MiB, file_bytes=8 * MiB, preallocate=False)
        with NvmeTier(c) as t:
            put(t, range(4)).result()
            b = put(t, range(4, 40))
            failed = [k for k, o in b.results.items() if o is IoResult.FAILED]
            assert failed and all(isinstance(b.errors[k], (NvmeDiskFullError, NvmeDisabledError)) for k in failed)
            assert any(isinstance(b.errors[k], NvmeDiskFullError) for k in failed)
            st = t.stats()
            assert not st.enabled and "disk full" in st.extra["disabled_reason"]
            with pytest.raises(NvmeDisabledError, match="disk full"):
                t.put_many([(NS, key(99), None, 0, data(99))])
            with pytest.raises(NvmeDisabledError):
                t.get_many([key(0)], [np.zeros(BLOCK, np.uint8)])
            stored = [k for k, o in b.results.items() if o is IoResult.OK]
        with NvmeTier(c) as t:  # what was acknowledged is still there
            assert {e.key for e in t.entries()} == {key(i) for i in range(4)} | set(stored)
            g, dsts = get(t, range(4))
            assert g.error is None and all(np.array_equal(d, data(i)) for i, d in enumerate(dsts))


def test_disk_full_on_index_commit_disables_the_tier(tmp_path):
    with tmpfs(tmp_path / "small", "3m") as mnt:
        with NvmeTier(cfg(mnt / "nvme", capacity_bytes=1 * MiB, file_bytes=1 * MiB)) as t:
            fill_up(mnt)  # data files are preallocated; only the index can grow now
            b = put(t, range(8), chunk=64)  # 1024 checksums per record: the index must grow
            assert set(b.results.values()) == {IoResult.FAILED}
            assert all(isinstance(e, NvmeDiskFullError) for e in b.errors.values())
            st = t.stats()
            assert not st.enabled and "disk full" in st.extra["disabled_reason"]
            assert (st.used_bytes, st.blocks) == (0, 0)  # written but uncommitted slots went back


def test_unwritable_directory_is_a_clear_error(tmp_path):
    f = tmp_path / "a-file"
    f.write_bytes(b"x")
    with pytest.raises(NvmeUnwritableError, match="not writable"):
        NvmeTier(cfg(f / "nvme"))
    with tmpfs(tmp_path / "ro", "1m", "ro") as mnt:
        with pytest.raises(NvmeUnwritableError, match="not writable"):
            NvmeTier(cfg(mnt / "nvme"))


def test_index_map_full_disables_the_tier_and_keeps_what_was_committed(tmp_path):
    c = cfg(tmp_path / "nvme", capacity_bytes=16 * MiB, file_bytes=8 * MiB, extent_bytes=1 * MiB,
            map_bytes=64 * KiB)
    committed = []
    with NvmeTier(c) as t:
        for n in range(64):
            b = put(t, range(n * 4, n * 4 + 4), nbytes=16 * KiB, chunk=512)
            committed += [k for k in b.keys if b.results[k] is IoResult.OK]
            if b.error is not None:
                break
        errs = set(map(type, b.errors.values()))
        assert errs == {NvmeIndexFullError}, errs
        assert "map_bytes" in str(next(iter(b.errors.values())))
        st = t.stats()
        assert not st.enabled and "index full" in st.extra["disabled_reason"]
        assert (st.blocks, st.used_bytes) == (len(committed), len(committed) * 16 * KiB)
        with pytest.raises(NvmeDisabledError):
            t.put_many([(NS, key(10_000), None, CHUNK, data(0))])
    assert committed
    with NvmeTier(cfg(tmp_path / "nvme", capacity_bytes=16 * MiB, file_bytes=8 * MiB, extent_bytes=1 * MiB)) as t:
        assert {e.key for e in t.entries()} == set(committed)
        ids = [i for i in range(len(committed) + 4) if key(i) in set(committed)]
        g, dsts = get(t, ids, nbytes=16 * KiB)
        assert g.error is None and all(np.array_equal(d, data(i, 16 * KiB)) for i, d in zip(ids, dsts))


def test_second_process_cannot_open_the_same_directory(tmp_path):
    c = cfg(tmp_path / "nvme")
    with NvmeTier(c):
        with pytest.raises(NvmeBusyError):
            NvmeTier(c)
    NvmeTier(c).close()


def test_geometry_change_is_refused_once_blocks_exist(tmp_path):
    NvmeTier(cfg(tmp_path / "nvme")).close()
    NvmeTier(cfg(tmp_path / "nvme", extent_bytes=256 * KiB)).close()  # empty: free to change
    with NvmeTier(cfg(tmp_path / "nvme", extent_bytes=256 * KiB)) as t:
        put(t, [0]).result()
    with pytest.raises(NvmeGeometryError, match="extent_bytes"):
        NvmeTier(cfg(tmp_path / "nvme"))


def test_filesystem_refusing_o_direct_falls_back_to_buffered(tmp_path):
    with tmpfs(tmp_path / "ram", "16m", fstype="ramfs") as mnt:  # ramfs: open(O_DIRECT) is EINVAL
        c = cfg(mnt / "nvme")
        with NvmeTier(c) as t:
            assert t.io_mode is IoMode.BUFFERED and t.stats().extra["io_mode"] == "buffered"
            put(t, range(5)).result()
        with NvmeTier(c) as t:
            g, dsts = get(t, range(5))
            assert g.error is None and all(np.array_equal(d, data(i)) for i, d in enumerate(dsts))
        with pytest.raises(NvmeIOError, match="Invalid argument"):
            NvmeTier(cfg(mnt / "nvme", io_mode=IoMode.DIRECT))  # asked for O_DIRECT explicitly


def test_buffered_mode_survives_restart(tmp_path):
    c = cfg(tmp_path / "nvme", io_mode=IoMode.BUFFERED)
    with NvmeTier(c) as t:
        assert t.stats().extra["io_mode"] == "buffered"
        put(t, range(5)).result()
    with NvmeTier(c) as t:
        g, dsts = get(t, range(5))
        assert g.error is None and all(np.array_equal(d, data(i)) for i, d in enumerate(dsts))


def test_closed_tier_refuses_work(tmp_path):
    t = NvmeTier(cfg(tmp_path / "nvme"))
    b = t.put_many([(NS, key(i), None, CHUNK, data(i)) for i in range(8)])
    t.close()  # in-flight puts finish first
    assert b.done() and b.error is None
    assert not t.stats().enabled and t.stats().extra["disabled_reason"] == "closed"
    with pytest.raises(NvmeDisabledError, match="closed"):
        t.put_many([(NS, key(9), None, 0, data(9))])
    t.close()
