"""Warm restart through real daemon processes: what DRAM holds at SIGTERM reaches NVMe (heads of
chains first) and the restarted daemon serves it; a shutdown cut short leaves only reachable,
bit-exact blocks; recovery reclaims blocks no prefix read can reach; admission never strands a
chain's tail on NVMe under a head that exists nowhere."""

import re
import signal
import time

import grpc
import numpy as np

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient
from kvstore.clients.leases import KVStoreError
from test_tiering import DRAM, LAYOUT, block_kv, nvme_args
from wait_util import wait_for

CHAIN = 16  # blocks per sequence


def seqs(n: int, base: int = 0, blocks: int = CHAIN) -> list[list[int]]:
    return [list(range((base + s) * 100_000, (base + s) * 100_000 + blocks * LAYOUT.block_tokens)) for s in range(n)]


def nvme_blocks(c: KVStoreClient) -> int:
    return {t.tier: t for t in c.stats().tiers}[3].blocks


def servable(c: KVStoreClient, all_toks) -> int:
    """Blocks a prefix read serves bit-exact (Lookup, then get and compare); AssertionError on a
    wrong byte."""
    n = 0
    for toks in all_toks:
        hit = c.lookup(toks)
        out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
        got = c.get(toks, out)
        assert got >= hit
        assert out[:, :, :got].tobytes() == block_kv(toks)[:, :, :got].tobytes(), "a wrong byte was served"
        n += got // LAYOUT.block_tokens
    return n


def fill(d, model: str, all_toks) -> None:
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, model)
    for toks in all_toks:
        assert c.put(toks, block_kv(toks)) == len(toks) // LAYOUT.block_tokens
    c.close()


def test_sigterm_writes_dram_to_nvme_and_a_restart_serves_it(tmp_path):
    """The finding: chains filling 3x DRAM, idle, SIGTERM, restart: (nearly) everything servable."""
    nv = tmp_path / "nvme"
    all_toks = seqs(24)  # 384 blocks of 256 KiB: 3 x DRAM, fits NVMe
    d = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM)
    try:
        fill(d, "warm", all_toks)
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "warm")
        wait_for(lambda: nvme_blocks(c) >= 384 - 128, what="demotion below the high watermark")
        c.close()
    finally:
        assert d.stop() == 0
    d2 = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM, name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "warm")
        assert servable(c, all_toks) >= 0.95 * 384
        c.close()
    finally:
        assert d2.stop() == 0
    assert "written to NVMe at shutdown" in d.log()


def test_shutdown_out_of_grace_leaves_only_reachable_bit_exact_blocks(tmp_path):
    """No grace to write DRAM out: whatever the next start recovers is bit-exact and reachable by
    a prefix read; the demoted tail of the chain whose head was only in DRAM is reclaimed."""
    nv = tmp_path / "nvme"
    all_toks = seqs(3, blocks=128)  # chains as long as DRAM: the last one's tail is demoted, its head is not
    d = start_daemon(tmp_path, *nvme_args(nv), "--server-shutdown-grace-s", "0", dram=DRAM)
    try:
        fill(d, "short", all_toks)
    finally:
        t0 = time.monotonic()
        assert d.stop() == 0
    assert time.monotonic() - t0 < 10
    d2 = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM, name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "short")
        on_nvme = nvme_blocks(c)
        assert servable(c, all_toks) == on_nvme
        c.close()
    finally:
        assert d2.stop() == 0
    assert "NVMe blocks unreachable" in d2.log()


def test_recovery_reclaims_tails_whose_head_is_gone(tmp_path):
    nv = tmp_path / "nvme"
    all_toks = seqs(8)
    args = nvme_args(nv, "--nvme-durable-commit", "true")
    d = start_daemon(tmp_path, *args, dram=DRAM)
    try:
        fill(d, "tails", all_toks)
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "tails")
        for toks in all_toks[:3]:
            assert c.delete(c.keys(toks)[:1]) == 1  # the head goes; its tail stays on NVMe
        c.close()
    finally:
        assert d.stop() == 0
    d2 = start_daemon(tmp_path, *args, dram=DRAM, name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "tails")
        assert nvme_blocks(c) == 5 * CHAIN
        assert servable(c, all_toks) == 5 * CHAIN
        c.close()
    finally:
        assert d2.stop() == 0
    m = re.search(r"(\d+) NVMe blocks unreachable", d2.log())
    assert m and int(m.group(1)) == 3 * (CHAIN - 1), d2.log()


def test_admission_never_strands_a_tail_under_a_dropped_head(tmp_path):
    """With ``admit_after_hits`` a tail looked up on its own is admitted to NVMe; its head, never
    looked up, must then follow it there rather than be dropped (which would leave the tail
    unreachable on NVMe)."""
    d = start_daemon(tmp_path, *nvme_args(tmp_path / "nvme", "--nvme-admit-after-hits", "1"), dram=DRAM)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "admit")
        (toks,) = seqs(1)
        assert c.put(toks, block_kv(toks)) == CHAIN
        keys = c.keys(toks)
        assert c.lookup_keys(keys[CHAIN // 2:]).hit_blocks == CHAIN // 2  # the tail alone is hit
        for more in seqs(12, base=1):  # 1.5 x DRAM of blocks never looked up: dropped, not admitted
            assert c.put(more, block_kv(more)) == CHAIN
        # The writes above evicted the oldest blocks, this chain first: its tail had to reach
        # NVMe (admitted) before its head became a leaf DRAM could drop.
        assert c.lookup_keys(keys).hit_blocks == nvme_blocks(c) == CHAIN
        out = np.zeros(LAYOUT.tensor_shape(len(toks)), np.float16)
        assert c.get(toks, out) == len(toks) and out.tobytes() == block_kv(toks).tobytes()
        c.close()
    finally:
        assert d.stop() == 0


def test_drain_refuses_new_writes_serves_reads_and_writes_dram_out(tmp_path):
    """SIGUSR1 (the Kubernetes preStop hook): Reserve gets UNAVAILABLE, reads go on, and DRAM is
    written to NVMe in the background, so the SIGTERM after it has nothing left to write."""
    nv = tmp_path / "nvme"
    all_toks = seqs(4)  # 64 blocks: DRAM only, under the demotion watermark
    d = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM)
    try:
        fill(d, "drain", all_toks)
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "drain")
        assert nvme_blocks(c) == 0
        d.proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: nvme_blocks(c) == 4 * CHAIN, what="the drain's write-out")
        (more,) = seqs(1, base=50)
        try:
            c.put(more, block_kv(more))
            raise AssertionError("a write was taken while draining")
        except KVStoreError as e:
            assert e.code is grpc.StatusCode.UNAVAILABLE and "draining" in e.message
        assert servable(c, all_toks) == 4 * CHAIN  # reads go on
        c.close()
    finally:
        assert d.stop() == 0
    assert "64 of 64 DRAM-only blocks written to NVMe while draining" in d.log()
    assert "0 of 0 DRAM-only blocks written to NVMe at shutdown" in d.log()
    d2 = start_daemon(tmp_path, *nvme_args(nv), dram=DRAM, name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(LAYOUT, "drain")
        assert servable(c, all_toks) == 4 * CHAIN
        c.close()
    finally:
        assert d2.stop() == 0
