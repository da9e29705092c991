"""The NVMe tier with a codec on (``nvme.codec``): blocks stored encoded in slots sized by their
payload, read back bit-exact, across restarts, under corruption, through the real daemon.

The blocks are bf16 KV-like values (normally distributed, as a layer's K and V are): the tier's
mechanics, not the codec's figures, which come from a trained model's KV in ``kvstore bench
codec``."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from kvstore.codec import native
from kvstore.daemon.metrics import Metrics
from kvstore.tiers.nvme import IoResult, NvmeTier
from kvstore.tiers.nvme.coded import BlockCoder, size_class
from kvstore.tiers.nvme.index import BlockRecord
import nvme_util
from nvme_util import CHUNK, NS, NS2, KiB, MiB, cfg, data, key, race_reads_with_churn
from test_nvme import flip_byte, write_at

pytestmark = pytest.mark.skipif(native() is None, reason="the C codec is built by make test (make codec)")
BLOCK = 256 * KiB  # size classes of 1/32 of the block: 8 KiB


def kv(i: int, nbytes: int = BLOCK) -> np.ndarray:
    """bf16 values of a normal distribution (a KV block's shape of values), as bytes."""
    x = np.random.default_rng(i).standard_normal(nbytes // 2).astype(np.float32) * 0.7
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


put = functools.partial(nvme_util.put, nbytes=BLOCK, make=kv, dtype="bf16")
get = functools.partial(nvme_util.get, nbytes=BLOCK)


def coded_cfg(path, codec="auto", **kw):
    return cfg(path, capacity_bytes=8 * MiB, file_bytes=4 * MiB, extent_bytes=1 * MiB, bounce_bytes=1 * MiB,
               codec=codec, **kw)


def records(c) -> dict[bytes, BlockRecord]:
    from kvstore.tiers.nvme.index import NvmeIndex

    idx = NvmeIndex(f"{c.dir}/index", c.map_bytes, False)
    try:
        return {k: BlockRecord.unpack(k, raw) for k, raw in idx.scan()}
    finally:
        idx.close()


def test_size_classes_are_32nds_of_the_block_in_whole_pages():
    assert size_class(256 * KiB, 190_000) == 24 * 8 * KiB  # 192 KiB: the next 1/32
    assert size_class(256 * KiB, 250_000) == 31 * 8 * KiB  # one 32nd saved
    assert size_class(256 * KiB, 255_000) == 0  # none: stored raw
    assert size_class(64 * KiB, 47_000) == 48 * KiB  # a 2 KiB 32nd rounds up to one 4 KiB page
    assert size_class(64 * KiB, 63_000) == 0
    assert size_class(64 * KiB, 0) == 0


def test_coder_settings():
    assert BlockCoder("off").codec_for("bf16") is None
    auto = BlockCoder("auto")
    assert auto.codec_for("bf16") and auto.codec_for("fp32") and auto.codec_for("fp8_e4m3")
    assert auto.codec_for("int8") is None and auto.codec_for(None) is None
    assert BlockCoder("planes-zstd").codec_for("int8")  # bytes of any whole-byte type
    with pytest.raises(ValueError, match="codec: expected one of"):
        BlockCoder("lz5")


def test_encoded_blocks_read_back_bit_exact_and_take_less_room(tmp_path):
    c = coded_cfg(tmp_path / "nvme")
    metrics = Metrics()
    with NvmeTier(c, metrics=metrics) as t:
        b = put(t, range(12))
        assert b.error is None and all(b.results[key(i)] is IoResult.OK for i in range(12))
        g, dsts = get(t, range(12))
        assert g.error is None and all(np.array_equal(d, kv(i)) for i, d in enumerate(dsts))
        assert g.nbytes == 12 * BLOCK  # the caller's bytes, raw
        st = t.stats()
        (use,) = st.extra["namespaces"].values()
        assert use["blocks"] == 12 and use["raw_bytes"] == 12 * BLOCK
        assert use["stored_bytes"] < use["slot_bytes"] < 12 * BLOCK / 1.2  # bf16 normal values: ~1.3x
        assert st.used_bytes == use["slot_bytes"]
        assert st.extra["codec"] == "auto"
        written = metrics.registry.get_sample_value("kvstore_nvme_io_bytes_total", {"op": "write"})
        assert written == use["stored_bytes"]  # what went to the disk: the payloads
    recs = records(c)
    assert {r.codec for r in recs.values()} == {2} and all(r.stored < r.slot_bytes < BLOCK for r in recs.values())


def test_the_same_capacity_holds_more_blocks(tmp_path):
    """Filled until NO_SPACE, raw and encoded, same capacity: the encoded tier holds >= 1.25x."""
    held = {}
    for codec in ("off", "auto"):
        with NvmeTier(coded_cfg(tmp_path / codec, codec)) as t:
            i = 0
            while True:
                b = put(t, range(i, i + 8))
                ok = sum(r is IoResult.OK for r in b.results.values())
                i += 8
                if ok < 8:
                    assert IoResult.NO_SPACE in b.results.values()  # back-pressure, known at completion
                    break
            held[codec] = t.stats().blocks
            g, dsts = get(t, range(held[codec]))
            assert g.error is None and all(np.array_equal(d, kv(j)) for j, d in enumerate(dsts))
    assert held["off"] == 8 * MiB // BLOCK
    assert held["auto"] >= 1.25 * held["off"], held


def test_a_full_tier_places_an_encoded_block_in_a_larger_free_slot_of_its_namespace(tmp_path):
    """No free extent, no free slot of the block's class, a free raw slot of its namespace: the
    block takes that slot (it was NO_SPACE while the extent had room), and reads back."""
    with NvmeTier(coded_cfg(tmp_path / "nvme")) as t:
        put(t, range(32), make=data, dtype=None).result()  # random bytes, raw: 32 slots, every extent
        assert t.put_many([(NS, key(99), None, CHUNK, kv(99), None, "bf16")]).wait(30)
        assert t.contains([key(99)]) == [False]  # full
        t.delete([key(5)])  # one raw slot free in a partly used extent
        b = put(t, [100])
        assert b.results[key(100)] is IoResult.OK
        e = {x.key: x for x in t.entries()}[key(100)]
        assert e.codec == 2 and e.stored < e.nbytes  # encoded, in the raw-sized slot that was free
        g, (d,) = get(t, [100])
        assert g.error is None and np.array_equal(d, kv(100))
    with NvmeTier(coded_cfg(tmp_path / "nvme")) as t:  # the slot is recovered as the size it is
        assert t.recovery.dropped == 0 and t.recovery.blocks == 32
        g, (d,) = get(t, [100])
        assert g.error is None and np.array_equal(d, kv(100))


def test_restart_recovers_encoded_and_raw_blocks_and_their_room(tmp_path):
    c = coded_cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, range(6)).result()
        put(t, range(4), ns=NS2, make=data).result()  # random bytes: do not shrink, stored raw
        put(t, range(10, 12), dtype=None).result()  # no element type named: raw
        before = t.stats()
    recs = records(c)
    assert sorted(r.codec for r in recs.values()) == [0] * 6 + [2] * 6
    with NvmeTier(c) as t:
        assert t.recovery.blocks == 12 and t.recovery.dropped == 0 and t.recovery.bytes == 12 * BLOCK
        st = t.stats()
        assert (st.used_bytes, st.blocks, st.extra["namespaces"]) == (before.used_bytes, 12, before.extra["namespaces"])
        assert st.extra["namespaces"][NS2.hex()]["ratio"] == 1.0
        put(t, range(6, 10)).result()  # new blocks never land on recovered ones
        g, dsts = get(t, range(12))
        assert g.error is None and all(np.array_equal(d, kv(i)) for i, d in enumerate(dsts))
        g, dsts = get(t, range(4), ns=NS2)
        assert g.error is None and all(np.array_equal(d, data(i, BLOCK)) for i, d in enumerate(dsts))
    with NvmeTier(coded_cfg(tmp_path / "nvme", "off")) as t:  # the codec turned off: still read
        g, dsts = get(t, range(12))
        assert g.error is None and all(np.array_equal(d, kv(i)) for i, d in enumerate(dsts))


@pytest.mark.parametrize("where", ["header", "codes", "tail"])
def test_a_corrupt_payload_is_a_counted_miss_never_data(tmp_path, where):
    """A flipped byte in the header fails the decode; one in the codes or low bits decodes to
    other bytes, which the raw checksums catch. Either way: CORRUPT, counted, dropped."""
    c = coded_cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, range(4)).result()
    rec = records(c)[key(2)]
    at = {"header": 9, "codes": 40 + 1000, "tail": rec.stored - 3}[where]
    flip_byte(c, rec.offset + at)
    metrics = Metrics()
    with NvmeTier(c, metrics=metrics) as t:
        g, dsts = get(t, range(4))
        assert g.results[key(2)] is IoResult.CORRUPT
        assert all(g.results[key(i)] is IoResult.OK and np.array_equal(dsts[i], kv(i)) for i in (0, 1, 3))
        assert t.contains([key(2)]) == [False]
        assert t.stats().extra["checksum_failures"] == 1
        assert metrics.registry.get_sample_value("kvstore_checksum_failures_total", {"source": "nvme"}) == 1
        assert t.stats().extra["namespaces"][NS.hex()]["blocks"] == 3


def test_a_truncated_payload_and_scrub(tmp_path):
    c = coded_cfg(tmp_path / "nvme")
    with NvmeTier(c) as t:
        put(t, range(5)).result()
        got = {e.key: e for e in t.entries()}
        rec = got[key(1)]
        assert rec.codec == 2 and rec.stored < rec.nbytes
        write_at(c, rec.slot + rec.stored - 4096, np.zeros(4096, np.uint8))  # the payload's tail zeroed
        flip_byte(c, got[key(3)].slot + 500)
        assert t.scrub() == 2
        assert t.contains([key(i) for i in range(5)]) == [True, False, True, False, True]
        g, dsts = get(t, [0, 2, 4])
        assert g.error is None and all(np.array_equal(d, kv(i)) for i, d in zip((0, 2, 4), dsts))


def test_deletes_and_reads_racing_encoded_puts_never_see_another_block(tmp_path):
    with NvmeTier(coded_cfg(tmp_path / "nvme")) as t:
        ids = range(8)
        _, bad = race_reads_with_churn(t, ids, range(100, 104), put, get, kv)
        assert not bad and t.stats().extra["checksum_failures"] == 0
        assert all(t.contains([key(i) for i in ids[1::2]]))
        # A delete while its put encodes: the put ends CANCELLED or OK-then-deleted, never stored.
        b = t.put_many([(NS, key(500), None, CHUNK, kv(500), None, "bf16")])
        t.delete([key(500)])
        assert b.wait(30) and b.results[key(500)] in (IoResult.CANCELLED, IoResult.OK)
        assert t.contains([key(500)]) == [False]
        assert t.stats().extra["pending_writes"] == 0
        # Deleted while it encodes, then put again: the write in flight stores it (it was lost).
        b1 = t.put_many([(NS, key(501), None, CHUNK, kv(501), None, "bf16")])
        t.delete([key(501)])
        b2 = t.put_many([(NS, key(501), None, CHUNK, kv(501), None, "bf16")])
        assert b1.wait(30) and b2.wait(30)
        assert t.contains([key(501)]) == [True]
        g, (d,) = get(t, [501])
        assert g.error is None and np.array_equal(d, kv(501))


# --- through the daemon --------------------------------------------------------------------------

def test_daemon_with_the_codec_stores_more_and_serves_every_block_exact_across_a_restart(tmp_path):
    from daemon_util import start_daemon
    from kvstore.clients import KVStoreClient
    from kvstore.keys import Namespace, chain_keys
    from kvstore.layout import KVLayout

    layout = KVLayout(8, 4, 128, "bf16", "mha")  # 256 KiB blocks
    nv = tmp_path / "nvme"
    args = ("--nvme-dir", str(nv), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
            "--nvme-codec", "auto")
    seqs = [list(range(s * 10_000, s * 10_000 + 32 * 16)) for s in range(4)]  # 128 blocks, 4 x DRAM

    def kv_of(toks):
        rng = np.random.default_rng(toks[0])
        x = rng.standard_normal(int(np.prod(layout.tensor_shape(len(toks))))).astype(np.float32) * 0.7
        return (x.view(np.uint32) >> 16).astype(np.uint16).reshape(layout.tensor_shape(len(toks)))

    def check_all(c) -> None:
        for toks in seqs:
            out = np.zeros(layout.tensor_shape(len(toks)), np.uint16)
            assert c.get(toks, out) == len(toks)
            assert out.tobytes() == kv_of(toks).tobytes()

    d = start_daemon(tmp_path, *args, "--nvme-durable-commit", "true", dram="8MiB")
    try:
        c = KVStoreClient(d.socket_path)
        c.register(layout, "coded")
        for toks in seqs:
            assert c.put(toks, kv_of(toks)) == 32
        check_all(c)
        out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--json", "--socket", d.socket_path],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        nvme = next(t for t in json.loads(out.stdout)["tiers"] if t["tier"] == "TIER_NVME")
        (use,) = json.loads(nvme["detail"])["namespaces"].values()  # the one namespace
        assert use["blocks"] == 128 and use["ratio"] > 1.2
        text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
        gauge = next(ln for ln in text.splitlines() if ln.startswith("kvstore_tier_codec_ratio{"))
        assert float(gauge.split()[-1]) == use["ratio"]
        c.close()
    finally:
        assert d.stop() == 0
    # One block's payload flipped on disk while the daemon is down.
    rec = records(cfg(nv, capacity_bytes=64 * MiB, file_bytes=32 * MiB, extent_bytes=4 * MiB))
    victim = chain_keys(Namespace("coded", layout).root, seqs[1], 16)[5]
    assert rec[victim].codec == 2
    flip_byte(cfg(nv, capacity_bytes=64 * MiB, file_bytes=32 * MiB), rec[victim].offset + 4321)
    d2 = start_daemon(tmp_path, *args, dram="8MiB", name="restarted")
    try:
        c = KVStoreClient(d2.socket_path)
        c.register(layout, "coded")
        assert c.lookup(seqs[1]) == 32 * 16  # the index lists it until a read checks it
        out = np.zeros(layout.tensor_shape(len(seqs[1])), np.uint16)
        assert c.get(seqs[1], out) == 5 * 16  # blocks 0-4; 5 corrupt: dropped
        assert out[:, :, :80].tobytes() == kv_of(seqs[1])[:, :, :80].tobytes()
        seqs.pop(1)
        check_all(c)
        text = urllib.request.urlopen(d2.metrics_url, timeout=5).read().decode()
        assert 'kvstore_checksum_failures_total{source="nvme"} 1.0' in text
        c.close()
    finally:
        assert d2.stop() == 0
