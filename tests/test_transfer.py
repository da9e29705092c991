"""Prefill daemon A -> decode daemon B through the real transfer listener (TCP and UCX)."""

import contextlib
import json
import os
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import faulty_daemon
from daemon_util import Daemons, DaemonSpec, cluster_secret, free_port
from wait_util import wait_for
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.transport import ucx_available
from kvstore.v1 import kvstore_pb2 as pb

LAYOUT = KVLayout(6, 2, 64, "fp16")  # 6 layers, 4 KiB chunks
_NO_UCX = pytest.mark.skipif(not ucx_available()[0], reason=f"UCX: {ucx_available()[1]}")
BACKENDS = ["tcp", pytest.param("ucx", marks=_NO_UCX)]
# UCX with daemon B's receiver verifying chunks on a pool of 2 threads (auto picks none on 2 CPUs).
UCX_POOL = pytest.param("ucx", ("--transport-verify-threads", "2", "--transport-verify-min-bytes", "0"),
                        marks=_NO_UCX, id="ucx-pool")


def pair(daemons: Daemons, backend, launcher_a=None, args_a=(), args=()):
    """Daemons A and B (started by ``daemons``, which stops them); ``args`` go to both,
    ``args_a`` to A only."""
    a, b = daemons.start(DaemonSpec((*args, *args_a), name="a", launcher=launcher_a, transfer=backend),
                         DaemonSpec(tuple(args), name="b", transfer=backend))
    return a, b, b.transfer_addr


@contextlib.contextmanager
def linked(tmp_path, backend, **kw):
    """:func:`pair` with a registered client on each daemon: yields ``(a, b, peer_b, ca, cb)``,
    then closes the clients and checks that both daemons exit cleanly."""
    daemons = Daemons(tmp_path)
    try:
        a, b, peer_b = pair(daemons, backend, **kw)
        ca, cb = clients(a, b)
        yield a, b, peer_b, ca, cb
        ca.close()
        cb.close()
    finally:
        daemons.stop_all()


def clients(a, b):
    ca, cb = KVStoreClient(a.socket_path), KVStoreClient(b.socket_path)
    ca.register(LAYOUT, "disagg-model")
    cb.register(LAYOUT, "disagg-model")
    return ca, cb


def kv_for(tokens, seed=0):
    return np.random.default_rng(seed).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)


def layers_of(kv, tokens):
    """``kv`` as [layer][K/V][token] bytes: what a worker writes into a layer of its blocks."""
    return kv.view(np.uint8).reshape(LAYOUT.num_layers, 2, len(tokens), -1)


def write_layer(w, src, layer: int) -> None:
    """Write layer ``layer`` of every block of the write lease ``w`` (16 tokens per block)."""
    for i in range(len(w.offsets)):
        w.layer_view(i, layer)[...] = src[layer, :, i * 16:(i + 1) * 16]


def dram_used(c):
    return c.stats().tiers[0].used_bytes


def released_to(c, base: int, timeout_s: float = 5.0) -> bool:
    """True once ``c``'s DRAM use is back to ``base`` (AssertionError after ``timeout_s``): a
    receiver tells the sender a transfer failed before it tears the connection down and
    releases its slots, so the sender's caller can look before they are."""
    return wait_for(lambda: dram_used(c) == base, timeout_s, f"DRAM use back to {base} bytes")


def expect_data_loss(c, keys, peer: str, what: str, deadline_s: float = 20) -> None:
    """A Transfer of ``keys`` to ``peer`` fails with DATA_LOSS and ``what`` in its message."""
    with pytest.raises(KVStoreError) as e:
        c.transfer(keys, peer, deadline_s=deadline_s)
    assert e.value.code.name == "DATA_LOSS" and what in e.value.message


def scribble(c, key: bytes, at: int, mask: int) -> None:
    """Flip bits of byte ``at`` of a committed block in the daemon's arena, behind its back
    (a stray write or a bit flip in DRAM)."""
    with c.acquire([key]) as lease:
        c.arena.view(lease.offsets[0] + at, 1)[0] ^= mask


@pytest.mark.parametrize("backend,args", [("tcp", ()), pytest.param("ucx", (), marks=_NO_UCX), UCX_POOL])
def test_blocks_arrive_bit_exact(tmp_path, backend, args):
    with linked(tmp_path, backend, args=args) as (a, b, peer_b, ca, cb):
        tokens = list(range(10 * 16 + 5))
        kv = kv_for(tokens)
        ca.put(tokens, kv)
        r = ca.transfer(ca.keys(tokens), peer_b, deadline_s=20)
        assert r.blocks == 10 and r.bytes == 10 * LAYOUT.block_bytes
        assert cb.lookup(tokens) == 160
        out = np.zeros_like(kv)
        assert cb.get(tokens, out) == 160
        assert out[:, :, :160].tobytes() == kv[:, :, :160].tobytes()
        # Shipping again is harmless: B already holds them and keeps exactly one copy.
        ca.transfer(ca.keys(tokens), peer_b, deadline_s=20)
        assert cb.stats().tiers[0].blocks == 10


@pytest.mark.parametrize("backend,progress", [("tcp", "adaptive"), pytest.param("ucx", "adaptive", marks=_NO_UCX),
                                               pytest.param("ucx", "blocking", marks=_NO_UCX),
                                               pytest.param("ucx", "polling", marks=_NO_UCX)])
def test_pipelined_layers_follow_the_doorbell(daemons, backend, progress):
    a, b, peer_b = pair(daemons, backend, args=("--transport-ucx-progress", progress))
    ca, cb = clients(a, b)
    tokens = list(range(4 * 16))
    kv = kv_for(tokens, 1)
    keys = ca.keys(tokens)
    src = layers_of(kv, tokens)
    w = ca.reserve(keys, doorbell=True)
    assert w.doorbell
    fut = ca.transfer(keys, peer_b, deadline_s=20, lease=w, wait=False)
    inc = cb.await_transfer(keys, wait_s=10)
    assert inc.lease_id and len(inc.offsets) == 4 and inc.layers_ready() == 0
    if backend == "ucx":  # the setting reached both engines: with a transfer open, only
        # blocking ones sleep (adaptive ones poll until it ends, polling ones always)
        assert_spins((a, b), spinning=progress != "blocking")
    for layer in range(LAYOUT.num_layers):  # "compute" layer l, write it, ring
        write_layer(w, src, layer)
        time.sleep(0.02)
        assert inc.layers_ready() <= layer  # nothing arrives before it is announced
        w.ring(layer + 1)
        inc.wait_layer(layer, timeout_s=10)  # the decode side starts on layer l now
        for i in range(4):
            assert inc.layer_view(i, layer).tobytes() == src[layer, :, i * 16:(i + 1) * 16].tobytes()
    w.commit()
    r = fut.result()
    assert r.blocks == 4
    inc.release()
    out = np.zeros_like(kv)
    assert cb.get(tokens, out) == 64 and out.tobytes() == kv.tobytes()
    ca.close()
    cb.close()
    if backend == "ucx":  # and with none open, only polling engines spin
        assert_spins((b,), spinning=progress == "polling")


def assert_spins(daemons, spinning: bool, over_s: float = 0.5) -> None:
    """Each daemon has a spinning thread (runnable > 70% of ``over_s``, however loaded the
    machine), or with ``spinning=False`` they all sleep (< 30% of a CPU over ``over_s``)."""
    if spinning:
        got = [busiest_thread_runnable_s(d, over_s) for d in daemons]
        assert all(g > 0.7 * over_s for g in got), got
    else:
        got = [cpu_seconds(d, over_s) for d in daemons]
        assert all(g < 0.3 * over_s for g in got), got


def cpu_seconds(d, over_s: float) -> float:
    """CPU seconds daemon ``d`` used (all threads) during the next ``over_s`` seconds."""
    def now() -> float:
        fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    before = now()
    time.sleep(over_s)
    return now() - before


def busiest_thread_runnable_s(d, over_s: float) -> float:
    """Seconds the busiest thread of daemon ``d`` was runnable (on a CPU or waiting in the run
    queue, /proc schedstat) during the next ``over_s`` seconds. A spinning thread scores about
    ``over_s`` however loaded the machine is, where CPU time would drop with its share."""
    task = f"/proc/{d.proc.pid}/task"

    def now() -> dict[str, int]:
        out = {}
        for tid in os.listdir(task):
            try:
                on_cpu, waiting = Path(f"{task}/{tid}/schedstat").read_text().split()[:2]
            except (FileNotFoundError, ProcessLookupError):
                continue  # the thread ended
            out[tid] = int(on_cpu) + int(waiting)
        return out
    before = now()
    time.sleep(over_s)
    after = now()
    return max(after[t] - before[t] for t in after if t in before) / 1e9


def test_a_pipelined_transfer_that_arrives_after_the_commit_ships_the_committed_blocks(tmp_path):
    """A short prefill can ring every layer and commit before the daemon even handles the
    Transfer RPC that names its lease: the blocks are complete, so they are shipped."""
    with linked(tmp_path, "tcp") as (a, b, peer_b, ca, cb):
        tokens = list(range(3 * 16))
        kv = kv_for(tokens, 9)
        keys = ca.keys(tokens)
        src = layers_of(kv, tokens)
        w = ca.reserve(keys, doorbell=True)
        for layer in range(LAYOUT.num_layers):
            write_layer(w, src, layer)
            w.ring(layer + 1)
        w.commit()
        assert ca.transfer(keys, peer_b, deadline_s=20, lease=w).blocks == 3
        out = np.zeros_like(kv)
        assert cb.get(tokens, out) == len(tokens) and out.tobytes() == kv.tobytes()
        other = ca.keys(list(range(500, 516)))  # a lease that is gone and blocks that are not there
        with pytest.raises(KVStoreError) as e:
            ca.transfer(other, peer_b, deadline_s=20, lease=w)
        assert e.value.code.name == "NOT_FOUND" and "unknown or expired" in e.value.message


def test_prefill_daemon_killed_mid_transfer(daemons):
    a, b, peer_b = pair(daemons, "tcp")
    ca, cb = clients(a, b)
    base = dram_used(cb)
    tokens = list(range(8 * 16))
    keys = ca.keys(tokens)
    w = ca.reserve(keys, doorbell=True)
    fut = ca.transfer(keys, peer_b, deadline_s=5, lease=w, wait=False)
    inc = cb.await_transfer(keys, wait_s=10)
    w.ring(2)  # two layers go out, then the prefill node dies
    inc.wait_layer(1, timeout_s=10)
    t0 = time.monotonic()
    a.kill()
    with pytest.raises(KVStoreError) as e:
        inc.wait_layer(LAYOUT.num_layers - 1, timeout_s=10)
    assert "failed" in e.value.message
    assert time.monotonic() - t0 < 6  # within the transfer's deadline
    with pytest.raises(KVStoreError):
        fut.result()
    inc.release()
    assert released_to(cb, base)  # every reserved slot released
    assert cb.lookup(tokens) == 0
    st = cb.stats()
    assert st.counters["kvstore_transfer_failures_total"] >= 1
    cb.close()


@pytest.mark.parametrize("backend,args", [("tcp", ()), UCX_POOL])
def test_corrupted_chunk_is_detected_and_not_stored(tmp_path, backend, args):
    corrupt_3rd_of_4_blocks = faulty_daemon.launcher(corrupt_frame=3)
    with linked(tmp_path, backend, launcher_a=corrupt_3rd_of_4_blocks, args=args) as (a, b, peer_b, ca, cb):
        tokens = list(range(4 * 16))
        ca.put(tokens, kv_for(tokens, 2))
        base = dram_used(cb)
        expect_data_loss(ca, ca.keys(tokens), peer_b, "CHECKSUM_MISMATCH", deadline_s=10)
        assert cb.lookup(tokens) == 0 and released_to(cb, base)
        assert cb.stats().counters["kvstore_transfer_failures_total"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_later_transfers_send_the_recorded_digests_so_changed_memory_is_caught(tmp_path, backend):
    """The first transfer of a committed block records its layer digests; later ones send them
    instead of hashing again. So bytes that change in A's DRAM afterwards (a stray write, a bit
    flip) fail the next transfer as DATA_LOSS rather than shipping the damage with a fresh hash."""
    with linked(tmp_path, backend) as (a, b, peer_b, ca, cb):
        tokens = list(range(3 * 16))
        kv = kv_for(tokens, 5)
        ca.put(tokens, kv)
        keys = ca.keys(tokens)
        ca.transfer(keys, peer_b, deadline_s=20)
        cb.delete(keys)
        ca.transfer(keys, peer_b, deadline_s=20)  # the recorded digests match the bytes: fine
        cb.delete(keys)
        scribble(ca, keys[1], 2 * LAYOUT.layer_chunk_bytes + 100, 0x40)  # block 1, layer 2
        base = dram_used(cb)
        expect_data_loss(ca, keys, peer_b, "CHECKSUM_MISMATCH")
        assert cb.lookup(tokens) == 0 and released_to(cb, base)


def test_digests_written_by_a_durable_commit_are_what_the_first_transfer_sends(tmp_path):
    """A durable commit hashes every layer chunk on its way to NVMe; the block keeps those
    digests, so even its first transfer does not hash again, and bytes changed in A's DRAM
    after the commit are caught on arrival (DATA_LOSS) instead of shipped under a fresh hash."""
    nvme = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
            "--nvme-durable-commit", "true")
    with linked(tmp_path, "tcp", args_a=nvme) as (a, b, peer_b, ca, cb):
        tokens = list(range(2 * 16))
        ca.put(tokens, kv_for(tokens, 6))
        keys = ca.keys(tokens)
        scribble(ca, keys[0], LAYOUT.layer_chunk_bytes + 7, 0x01)  # block 0, layer 1
        expect_data_loss(ca, keys, peer_b, "block 0, layer 1,")  # a run names the layer
        assert cb.lookup(tokens) == 0


def test_blocks_read_back_from_an_encoded_nvme_tier_arrive_bit_exact(tmp_path):
    """A's NVMe tier stores blocks encoded (nvme.codec); blocks demoted there and promoted back
    for a transfer (decoded, checked against the raw checksums) reach B bit for bit."""
    nvme = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
            "--nvme-codec", "planes-zstd", "--dram-extent-bytes", "1MiB", "--dram-capacity-bytes", "2MiB")
    with linked(tmp_path, "tcp", args_a=nvme) as (a, b, peer_b, ca, cb):
        prompts = [list(range(s * 1000, s * 1000 + 16 * 16)) for s in range(4)]  # 64 blocks, DRAM holds 42
        for i, t in enumerate(prompts):
            assert ca.put(t, kv_for(t, 10 + i)) == 16
        first = prompts[0]
        nvme_a = lambda: next(t for t in ca.stats().tiers if t.tier == pb.TIER_NVME)  # noqa: E731
        wait_for(lambda: nvme_a().blocks >= 16, what="A demotes its oldest prompt to NVMe")
        (use,) = json.loads(nvme_a().detail)["namespaces"].values()
        assert use["blocks"] >= 16 and use["slot_bytes"] < use["raw_bytes"]  # stored encoded
        with ca.acquire(ca.keys(first), wait_s=20) as lease:  # promoted: read and decoded
            assert len(lease.offsets) == 16
        r = ca.transfer(ca.keys(first), peer_b, deadline_s=20)
        assert r.blocks == 16
        out = np.zeros(LAYOUT.tensor_shape(len(first)), np.float16)
        assert cb.get(first, out) == len(first)
        assert out.tobytes() == kv_for(first, 10).tobytes()


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_compressed_transfers_arrive_bit_exact_in_fewer_wire_bytes(tmp_path, mode):
    """transport.compress: bf16 blocks travel encoded over TCP (on; auto: this loopback link is
    faster than compress_below_bytes_per_s until that is raised above it), committed and
    layer-pipelined, and B serves them bit for bit."""
    from kvstore.codec import native

    if native() is None:
        pytest.skip("the C codec is built by make test (make codec)")
    args = ("--transport-compress", mode) + (("--transport-compress-below-bytes-per-s", "1e15") if mode == "auto" else ())
    bf16 = KVLayout(6, 2, 64, "bf16")
    with linked(tmp_path, "tcp", args=args) as (a, b, peer_b, ca, cb):
        xa, xb = KVStoreClient(a.socket_path), KVStoreClient(b.socket_path)
        xa.register(bf16, "compressed")
        xb.register(bf16, "compressed")
        tokens = list(range(8 * 16))
        x = np.random.default_rng(11).standard_normal(bf16.tensor_shape(len(tokens))).astype(np.float32) * 0.5
        kv = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
        assert xa.put(tokens, kv) == 8
        r = xa.transfer(xa.keys(tokens), peer_b, deadline_s=20)
        assert r.blocks == 8 and r.bytes == 8 * bf16.block_bytes
        out = np.zeros_like(kv)
        assert xb.get(tokens, out) == len(tokens)
        assert out.tobytes() == kv.tobytes()
        text = urllib.request.urlopen(a.metrics_url, timeout=5).read().decode()
        sample = lambda name: float(text.split(f'{name}_total{{backend="tcp",direction="send"}} ')[1].split()[0])  # noqa: E731
        assert sample("kvstore_transfer_wire_bytes") < sample("kvstore_transfer_bytes") / 1.2
        # Layer-pipelined: each layer as the writer rings for it, encoded chunk by chunk.
        toks2 = list(range(5000, 5000 + 4 * 16))
        src = kv[:, :, :len(toks2)].copy()
        keys2 = xa.keys(toks2)
        w = xa.reserve(keys2, doorbell=True)
        fut = xa.transfer(keys2, peer_b, deadline_s=20, lease=w, wait=False)
        layers = src.view(np.uint8).reshape(bf16.num_layers, 2, len(toks2), -1)
        for layer in range(bf16.num_layers):
            for i in range(len(w.offsets)):
                w.layer_view(i, layer)[...] = layers[layer, :, i * 16:(i + 1) * 16]
            w.ring(layer + 1)
        w.commit()
        assert fut.result().blocks == 4
        out2 = np.zeros_like(src)
        assert xb.get(toks2, out2) == len(toks2) and out2.tobytes() == src.tobytes()
        xa.close()
        xb.close()


def test_digests_taken_at_commit_are_what_the_first_transfer_sends(tmp_path):
    """Without any NVMe tier, the commit hashes every layer chunk and the block keeps those
    digests: its first transfer hashes nothing on the send path, so bytes changed in A's DRAM
    after the commit are caught on arrival (DATA_LOSS) instead of shipped under a fresh hash."""
    with linked(tmp_path, "tcp") as (a, b, peer_b, ca, cb):
        tokens = list(range(2 * 16))
        ca.put(tokens, kv_for(tokens, 8))
        keys = ca.keys(tokens)
        scribble(ca, keys[1], 3 * LAYOUT.layer_chunk_bytes + 5, 0x20)  # block 1, layer 3
        expect_data_loss(ca, keys, peer_b, "block 1, layer 3,")
        assert cb.lookup(tokens) == 0


def test_the_receiver_keeps_the_digests_it_verified(tmp_path):
    """B records the digests it verified on arrival, so when B ships those blocks on (here back
    to A) it hashes nothing, and bytes changed in B's DRAM in between are caught (DATA_LOSS)."""
    with linked(tmp_path, "tcp") as (a, b, peer_b, ca, cb):
        peer_a = a.transfer_addr
        tokens = list(range(2 * 16))
        ca.put(tokens, kv_for(tokens, 7))
        keys = ca.keys(tokens)
        ca.transfer(keys, peer_b, deadline_s=20)
        # B has never sent these blocks: only the digests it verified on arrival are known
        scribble(cb, keys[1], 4 * LAYOUT.layer_chunk_bytes, 0x80)  # block 1, layer 4
        expect_data_loss(cb, keys, peer_a, "block 1, layer 4,")
        ca.delete(keys)
        cb.transfer(keys[:1], peer_a, deadline_s=20)  # block 0 is intact and goes through
        assert ca.lookup(tokens[:16]) == 16


def test_transfers_work_again_after_the_peer_restarts(daemons):
    a, b, peer_b = pair(daemons, "tcp")
    ca, cb = clients(a, b)
    tokens = list(range(3 * 16))
    ca.put(tokens, kv_for(tokens, 3))
    ca.transfer(ca.keys(tokens), peer_b, deadline_s=10)
    cb.close()
    b.stop_cleanly()
    with pytest.raises(KVStoreError):
        ca.transfer(ca.keys(tokens), peer_b, deadline_s=3)  # peer down: a clear failure
    b = daemons(name="b2", transfer="tcp", transfer_addr=peer_b)
    cb = KVStoreClient(b.socket_path)
    cb.register(LAYOUT, "disagg-model")
    assert cb.lookup(tokens) == 0  # DRAM only: the restart emptied it
    assert ca.transfer(ca.keys(tokens), peer_b, deadline_s=10).blocks == 3
    assert cb.lookup(tokens) == 48
    ca.close()
    cb.close()


def test_bad_transfer_requests(tmp_path):
    with linked(tmp_path, "tcp") as (a, b, peer_b, ca, cb):
        tokens = list(range(2 * 16))
        with pytest.raises(KVStoreError, match="no committed block"):
            ca.transfer(ca.keys(tokens), peer_b)
        ca.put(tokens, kv_for(tokens))
        with pytest.raises(KVStoreError, match="peer"):
            ca.transfer(ca.keys(tokens), "not-an-address")
        with pytest.raises(KVStoreError) as e:
            ca.transfer(ca.keys(tokens), f"127.0.0.1:{free_port()}", deadline_s=2)
        assert e.value.code.name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
        w = ca.reserve(ca.keys(list(range(100, 132))))
        with pytest.raises(KVStoreError, match="doorbell"):
            ca.transfer(w.keys, peer_b, lease=w)
        w.abort()
        r = cb.await_transfer(ca.keys([7] * 16), wait_s=0.2)
        assert r.state == pb.TRANSFER_UNKNOWN  # nothing is coming


@pytest.fixture
def two_netns():
    from netns_util import veth_pair

    with veth_pair("kvd", 232) as pair:
        yield pair


def test_daemons_in_separate_network_namespaces(daemons, two_netns):
    (ns_a, addr_a), (ns_b, addr_b) = two_netns
    secret = ("--transport-secret-file", cluster_secret(daemons.workdir))  # off loopback: authenticated
    a, b = daemons.start(DaemonSpec(("--transport-listen", f"{addr_a}:7470", *secret), name="a", prefix=["ip", "netns", "exec", ns_a]),
                         DaemonSpec(("--transport-listen", f"{addr_b}:7470", *secret), name="b", prefix=["ip", "netns", "exec", ns_b]))
    ca, cb = clients(a, b)  # control over each daemon's unix socket; data crosses the veth
    tokens = list(range(6 * 16))
    kv = kv_for(tokens, 4)
    ca.put(tokens, kv)
    assert ca.transfer(ca.keys(tokens), f"{addr_b}:7470", deadline_s=20).blocks == 6
    out = np.zeros_like(kv)
    assert cb.get(tokens, out) == 96 and out.tobytes() == kv.tobytes()
    with pytest.raises(KVStoreError):
        ca.transfer(ca.keys(tokens), "127.0.0.1:7470", deadline_s=2)  # B is not on A's loopback
    ca.close()
    cb.close()


def test_committed_blocks_travel_in_runs_of_about_4_mib():
    from kvstore.daemon.outbound import RUN_BYTES, run_layers
    assert RUN_BYTES == 4 << 20
    assert run_layers(64 << 10, 32) == 32   # a whole 2 MiB block in one message
    assert run_layers(64 << 10, 80) == 64   # 80 layers: runs of 64 (4 MiB) and 16
    assert run_layers(1 << 20, 32) == 4
    assert run_layers(4 << 20, 32) == 1     # already message-sized: one layer each
    assert run_layers(16 << 20, 32) == 1
