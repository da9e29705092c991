"""DRAM <-> NVMe through the real daemon: more than RAM, restarts, crashes, corruption,
prefetch deadlines, a broken NVMe directory."""

import json
import multiprocessing as mp
import os
import time
import urllib.request

import numpy as np

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout
from kvstore.tier_kind import TierKind

LAYOUT = KVLayout(8, 4, 128, "fp16", "mha")  # 256 KiB blocks
DRAM = "32MiB"  # 128 blocks


def nvme_args(d, *extra):
    return ("--nvme-dir", str(d), "--nvme-capacity-bytes", "256MiB", "--nvme-file-bytes", "128MiB", *extra)


def block_kv(tokens):
    """Content that is a function of the token ids, so any block read back can be checked."""
    kv = np.empty(LAYOUT.tensor_shape(len(tokens)), np.float16)
    t = (np.asarray(tokens) % 2039).astype(np.float16)
    kv[...] = t[None, None, :, None, None] + np.arange(128, dtype=np.float16)[None, None, None, None, :] / 256
    return kv


def test_store_four_times_dram_and_read_back(tmp_path):
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "big")
        seqs = [list(range(s * 100_000, s * 100_000 + 64 * 16)) for s in range(8)]  # 8 x 64 blocks = 4 x DRAM
        for toks in seqs:
            assert c.put(toks, block_kv(toks)) == 64
        st = {t.tier: t for t in c.stats().tiers}
        assert st[3].blocks >= 512 - 128 and st[3].enabled
        for toks in seqs:
            out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
            assert c.get(toks, out) == len(toks)
            assert out.tobytes() == block_kv(toks).tobytes()
        text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
        assert 'kvstore_demotions_total{dst="nvme",src="dram"}' in text
        assert float(text.split('kvstore_promotions_total{dst="dram",src="nvme"} ')[1].split()[0]) > 0
        c.close()
    finally:
        assert d.stop() == 0


def _writer(sock, acked_path, stop_after):
    c = KVStoreClient(sock)
    c.register(LAYOUT, "crash")
    with open(acked_path, "a") as log:
        for s in range(stop_after):
            toks = list(range(s * 1000, s * 1000 + 4 * 16))
            c.put(toks, block_kv(toks))
            log.write(f"{s}\n")  # acknowledged: Commit returned
            log.flush()


def test_sigkill_during_writes_keeps_every_acknowledged_block(tmp_path):
    nv = tmp_path / "nvme"
    d = start_daemon(tmp_path, *nvme_args(nv, "--nvme-durable-commit", "true"), dram=DRAM)
    acked = tmp_path / "acked"
    ctx = mp.get_context("spawn")
    w = ctx.Process(target=_writer, args=(d.socket_path, str(acked), 10_000))
    w.start()
    deadline = time.monotonic() + 60
    while (not acked.exists() or len(acked.read_text().split()) < 40) and time.monotonic() < deadline:
        time.sleep(0.05)
    d.kill()  # SIGKILL in the middle of the write stream
    w.join(30)
    if w.is_alive():
        w.kill()
    done = [int(x) for x in acked.read_text().split()]
    assert len(done) >= 40
    d2 = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM, name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "crash")
        for s in done:
            toks = list(range(s * 1000, s * 1000 + 4 * 16))
            out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
            assert c.get(toks, out) == len(toks), f"acknowledged sequence {s} lost"
            assert out.tobytes() == block_kv(toks).tobytes()
        # Whatever was in flight is either absent or intact, never wrong.
        s = max(done) + 1
        toks = list(range(s * 1000, s * 1000 + 4 * 16))
        out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
        n = c.get(toks, out)
        assert out[:, :, :n].tobytes() == block_kv(toks)[:, :, :n].tobytes()
        c.close()
    finally:
        assert d2.stop() == 0


def test_flipped_byte_is_detected_and_never_served(tmp_path):
    nv = tmp_path / "nvme"
    d = start_daemon(tmp_path, *nvme_args(nv, "--nvme-durable-commit", "true"), dram=DRAM)
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "flip")
    toks = list(range(4 * 16))
    c.put(toks, block_kv(toks))
    c.close()
    assert d.stop() == 0
    from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

    t = NvmeTier(NvmeTierConfig(dir=str(nv), capacity_bytes=256 << 20, file_bytes=128 << 20, extent_bytes=4 << 20))
    entries = {e.key: e for e in t.entries()}
    t.close()
    from kvstore.keys import Namespace, chain_keys

    ks = chain_keys(Namespace("flip", LAYOUT).root, toks, 16)
    victim = entries[ks[2]]
    files = sorted(p for p in os.listdir(nv) if p.startswith("data"))
    with open(nv / files[victim.slot // (128 << 20)], "r+b") as f:
        f.seek(victim.slot % (128 << 20) + 12345)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    d2 = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM, name="after-flip")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "flip")
        assert c.lookup(toks) == 64  # the index still lists it until a read checks it
        out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
        assert c.get(toks, out) == 32  # blocks 0 and 1 good; block 2 corrupt: dropped, not served
        assert out[:, :, :32].tobytes() == block_kv(toks)[:, :, :32].tobytes()
        assert not out[:, :, 32:].any()
        assert c.lookup(toks) == 32
        text = urllib.request.urlopen(d2.metrics_url, timeout=5).read().decode()
        assert 'kvstore_checksum_failures_total{source="nvme"} 1.0' in text
        c.close()
    finally:
        assert d2.stop() == 0


def test_prefetch_with_an_impossible_deadline_returns_partial_in_time(tmp_path):
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-durable-commit", "true"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "pf")
        toks = list(range(96 * 16))
        c.put(toks, block_kv(toks))
        keys = c.keys(toks)
        # Push everything out of DRAM: another sequence of 128 blocks.
        other = list(range(10**6, 10**6 + 128 * 16))
        c.put(other, block_kv(other))
        assert {t.tier: t.blocks for t in c.stats().tiers}[3] >= 96
        h = c.prefetch(keys, deadline_s=0.005)
        t0 = time.monotonic()
        r = c.prefetch_status(h, wait_s=30.0)
        took = time.monotonic() - t0
        assert r.state in (2, 1)  # PARTIAL, or DONE if the disk beat 5 ms
        assert took < 10, f"status waited {took:.2f} s past a 5 ms deadline (for its 30 s wait_s?)"
        if r.state == 2:
            assert r.ready_blocks < 96 and "recompute" in r.detail
        h2 = c.prefetch(keys, deadline_s=30)
        r2 = c.prefetch_status(h2, wait_s=30)
        assert r2.state == 1 and r2.ready_blocks == 96
        c.close()
    finally:
        assert d.stop() == 0


def test_unusable_nvme_directory_disables_the_tier_and_dram_keeps_serving(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    d = start_daemon(tmp_path, *nvme_args(blocker / "nvme", "--nvme-durable-commit", "true"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "m")
        assert c.info.durable_commit is False  # asked for, but there is no NVMe tier to wait for
        toks = list(range(32))
        assert c.put(toks, block_kv(toks)) == 2
        nv = {t.tier: t for t in c.stats().tiers}[3]
        assert not nv.enabled and "nvme" in nv.detail
        out = subprocess_stats(d.socket_path)
        assert "DISABLED" in out
        c.close()
    finally:
        assert d.stop() == 0


def subprocess_stats(sock):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kvstore", "stats", "--socket", sock], capture_output=True,
                          text=True, timeout=30).stdout


def test_per_namespace_nvme_quota(tmp_path):
    """A namespace over nvme.namespace_quota_bytes loses its own least recent NVMe blocks; the
    other namespace's blocks stay."""
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-durable-commit", "true",
                                          "--nvme-namespace-quota-bytes", "8MiB"), dram=DRAM)  # 32 blocks
    try:
        a, b = KVStoreClient(d.socket_path), KVStoreClient(d.socket_path)
        a.register(LAYOUT, "tenant-a")
        b.register(LAYOUT, "tenant-b")
        tb = list(range(5_000_000, 5_000_000 + 16 * 16))
        b.put(tb, block_kv(tb))
        ta = list(range(48 * 16))
        a.put(ta, block_kv(ta))
        rows = {r["model_id"]: r for r in json.loads(subprocess_ls(d.socket_path))}
        assert rows["tenant-b"]["blocks"].get("nvme", 0) + rows["tenant-b"]["blocks"].get("dram", 0) == 16
        out = np.zeros(LAYOUT.tensor_shape(len(tb)), np.float16)
        assert b.get(tb, out) == len(tb) and out.tobytes() == block_kv(tb).tobytes()
        nvme_a = [t for t in a.stats().tiers if t.tier == 3][0]
        assert nvme_a.blocks <= 32 + 16  # tenant-a holds at most its 32-block quota on NVMe
        a.close()
        b.close()
    finally:
        assert d.stop() == 0


def subprocess_ls(sock):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kvstore", "ls", "--json", "--socket", sock], capture_output=True,
                          text=True, timeout=30).stdout


def test_graceful_restart_keeps_the_lru_order_of_lookups(tmp_path):
    """Recency earned by lookups of DRAM copies survives a graceful restart: the index's access
    times follow the daemon's LRU, not only the order blocks were written to NVMe."""
    from kvstore.tiers.nvme.index import BlockRecord, NvmeIndex

    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-durable-commit", "true"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "recency")
        assert c.info.durable_commit is True
        first, second = list(range(16 * 4)), list(range(900_000, 900_000 + 16 * 4))
        assert c.put(first, block_kv(first)) == 4
        time.sleep(0.05)
        assert c.put(second, block_kv(second)) == 4  # written later: newer on NVMe
        assert c.lookup(first) == len(first)  # but `first` was used last
        keys_first, keys_second = c.keys(first), c.keys(second)
        c.close()
    finally:
        assert d.stop() == 0
    idx = NvmeIndex(str(tmp_path / "nvme" / "index"), 64 << 20, durable=False)
    try:
        atime = {k: BlockRecord.unpack(k, raw).atime for k, raw in idx.scan()}
    finally:
        idx.close()
    assert max(atime[k] for k in keys_second) < min(atime[k] for k in keys_first)
    # The restarted daemon serves them all.
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-durable-commit", "true"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "recency")
        assert c.lookup(first) == len(first) and c.lookup(second) == len(second)
        c.close()
    finally:
        assert d.stop() == 0


def test_reserve_waits_in_the_daemon_while_demotion_makes_room(tmp_path):
    """DRAM full of blocks only DRAM holds: a Reserve that asks for room waits in the daemon
    until the demoter has moved enough to NVMe, so even a client that never retries gets it."""
    # A wait far past what demoting 16 blocks takes, so a loaded machine cannot fail the test.
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-high-watermark", "1.0",
                                          "--nvme-low-watermark", "0.9"), "--server-reserve-wait-s", "20",
                     dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "wait")
        for s in range(8):  # 8 x 16 blocks = the whole DRAM tier; high watermark 1.0: no demotion yet
            toks = list(range(s * 100_000, s * 100_000 + 16 * 16))
            assert c.put(toks, block_kv(toks)) == 16
        assert {t.tier: t for t in c.stats().tiers}[3].blocks == 0
        new = c.keys(list(range(9_000_000, 9_000_000 + 16 * 16)))
        t0 = time.monotonic()
        w = c.reserve(new, retry_s=0)  # the client does not retry: only the daemon's wait helps
        assert time.monotonic() - t0 < 20
        assert sum(1 for o in w.offsets if o is not None) == 16
        w.abort()
        assert {t.tier: t for t in c.stats().tiers}[3].blocks >= 16  # demoted to make the room
        c.close()
    finally:
        assert d.stop() == 0


def test_a_lookup_for_a_load_starts_reading_its_nvme_blocks(tmp_path):
    """Lookup(promote_from, promote_to): the NVMe blocks of the hit past ``promote_from`` (and
    not past ``promote_to``) move into DRAM without an Acquire (an engine's scheduler asks
    before its worker Acquires them); a plain Lookup moves nothing, and what was promoted reads
    back whole."""
    args = nvme_args(tmp_path / "nvme", "--nvme-durable-commit", "true")
    toks = list(range(16 * 12))
    d = start_daemon(tmp_path, *args, dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "promote")
        assert c.put(toks, block_kv(toks)) == 12
        c.close()
    finally:
        assert d.stop() == 0
    d = start_daemon(tmp_path, *args, dram=DRAM)  # DRAM empty, the NVMe index recovered
    try:
        c = KVStoreClient(d.socket_path)
        # A prefill rate this slow makes every hit block worth loading, however slow this loaded
        # machine measures its disk: load_blocks is the whole hit.
        c.register(LAYOUT, "promote", prefill_tokens_per_s=1.0)
        keys = c.keys(toks)
        nvme = bytes([TierKind.NVME]) * 12
        assert c.lookup_keys(keys).tiers == nvme
        time.sleep(0.3)
        assert c.lookup_keys(keys).tiers == nvme  # a Lookup alone reads nothing
        # promote_to bounds it too (an engine computes its prompt's last block, though it looks it up)
        r = c.lookup_keys(keys, promote_from=4, promote_to=5)
        assert r.hit_blocks == 12 and r.load_blocks == 12, r
        deadline = time.monotonic() + 10
        while c.lookup_keys(keys).tiers[4] != TierKind.DRAM and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert c.lookup_keys(keys).tiers == nvme[:4] + bytes([TierKind.DRAM]) + nvme[5:]  # block 4 alone
        r = c.lookup_keys(keys, promote_from=4)
        assert r.hit_blocks == 12 and r.load_blocks == 12, r
        want = bytes([TierKind.NVME]) * 4 + bytes([TierKind.DRAM]) * (r.load_blocks - 4)  # as far as advised

        def landed() -> bool:
            return c.lookup_keys(keys).tiers[:r.load_blocks] == want

        deadline = time.monotonic() + 10
        while not landed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert landed(), c.lookup_keys(keys).tiers
        text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
        assert float(text.split('kvstore_promotions_total{dst="dram",src="nvme"} ')[1].split()[0]) == r.load_blocks - 4
        out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
        assert c.get(toks, out) == len(toks)
        assert out.tobytes() == block_kv(toks).tobytes()
        c.close()
    finally:
        assert d.stop() == 0
