"""KV events from a real daemon, read as a router reads vLLM's: decoded with vLLM's own
``KVEventBatch``, live on the PUB socket and through the replay socket, tier moves included."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from daemon_util import DaemonSpec
from events_util import Live, ask, events_of, replay
from kvstore.clients import KVStoreClient
from kvstore.clients.leases import KVStoreError
from kvstore.daemon import transfer_meta
from kvstore.daemon.index import Block
from kvstore.layout import KVLayout
from kvstore.tier_kind import TierKind
from kvstore.transport import Sender, TransferConfig, TransferError, TransferStatus
from kvstore.v1 import kvstore_pb2 as pb
from wait_util import wait_for
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored

LAYOUT = KVLayout(4, 2, 64, "fp16", block_tokens=16)  # 32 KiB blocks
BT = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def pair(module_daemons, tmp_path_factory):
    """Daemon B, the one read (events, replay, durable NVMe, a transfer listener), and daemon A
    (events on, so it keeps token ids), which ships blocks to B; started together."""
    d = tmp_path_factory.mktemp("ev")
    pub, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    b_flags = ("--events-publish", pub, "--events-replay", rep, "--dram-prefault", "false",
               "--nvme-dir", str(d / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "64MiB",
               "--nvme-durable-commit", "true")
    a_flags = ("--events-publish", f"ipc://{d}/a-pub", "--dram-prefault", "false")
    a, b = module_daemons.start(DaemonSpec(a_flags, name="a", dram="8MiB", transfer="tcp"),
                                DaemonSpec(b_flags, name="b", dram="8MiB", transfer="tcp"))
    b.pub, b.replay = pub, rep
    return a, b


@pytest.fixture(scope="module")
def daemon(pair):
    return pair[1]


def client(daemon, model: str, salt: str = "") -> KVStoreClient:
    c = KVStoreClient(daemon.socket_path, timeout_s=10)
    c.register(LAYOUT, model, tenant_salt=salt)
    return c


def kv(n_tokens: int) -> np.ndarray:
    return np.zeros(LAYOUT.tensor_shape(n_tokens), np.float16)


def where(events) -> dict[bytes, set[str]]:
    """Each key's tiers after applying ``events`` in order."""
    held: dict[bytes, set[str]] = {}
    for e in events:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        for k in e.block_hashes if not isinstance(e, AllBlocksCleared) else ():
            tiers = held.setdefault(k, set())
            (tiers.add if isinstance(e, BlockStored) else tiers.discard)(e.medium)
            if not tiers:
                del held[k]
    return held


def test_a_put_is_announced_with_its_token_ids_and_tenant_salt(daemon):
    c = client(daemon, "fmt", salt="tenant-a")
    tokens = list(range(1000, 1000 + 3 * BT + 5))  # 3 full blocks and a partial one
    keys = c.keys(tokens)
    assert c.put(tokens, kv(len(tokens))) == 3

    def stored():
        return [e for e in events_of(replay(daemon.replay)) if isinstance(e, BlockStored) and e.block_hashes[0] == keys[0]]

    by_medium = {e.medium: e for e in wait_for(lambda: len(stored()) == 2 and stored(), what="CPU and STORAGE stores")}
    cpu = by_medium[MEDIUM_CPU]
    assert cpu.block_hashes == keys and cpu.parent_block_hash is None
    assert cpu.token_ids == tokens[:3 * BT] and cpu.block_size == BT
    assert cpu.extra_keys == [("tenant-a",)] * 3 and cpu.ownership == "kvstore" and cpu.lora_id is None
    assert by_medium[MEDIUM_STORAGE].block_hashes == keys  # durable commit: on NVMe before the answer
    c.close()


def cpu_store(daemon, first_key: bytes) -> BlockStored:
    """The DRAM ``BlockStored`` of the run that starts at ``first_key``, once announced."""
    def find():
        return [e for e in events_of(replay(daemon.replay))
                if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU and e.block_hashes[0] == first_key]

    return wait_for(find, what="the store announced")[0]


def test_token_ids_that_do_not_hash_to_the_keys_are_refused(daemon):
    c = client(daemon, "liar")
    keys = c.keys(range(2 * BT))
    with pytest.raises(KVStoreError) as e:
        c.reserve(keys, token_ids=list(range(1, 2 * BT + 1)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "block 0" in e.value.message
    with pytest.raises(KVStoreError) as e:
        c.call("Reserve", pb.ReserveRequest(session_id=c.session_id, keys=b"".join(keys), token_ids=b"\0" * 12))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.message
    c.close()


def test_evictions_promotions_and_deletes_are_announced_per_tier(daemon):
    c = client(daemon, "tiers")
    tokens = np.arange(300 * BT) + 50_000  # 300 blocks: more than the 8 MiB of DRAM holds
    keys = c.keys(tokens)
    for end in range(50 * BT, len(tokens) + 1, 50 * BT):  # a growing prefix, as a conversation grows
        c.put(tokens[:end], kv(end))  # the first blocks leave DRAM to make room
    # Pieces of a put commit in any order, so the last block may be announced on NVMe first.
    held = wait_for(lambda: (h := where(events_of(replay(daemon.replay)))) and
                    all(MEDIUM_STORAGE in h.get(k, ()) for k in keys) and h, what="every block announced on NVMe")
    # Which copies left DRAM depends on who made room first: the demoter drops the oldest
    # (already on NVMe), a Reserve that finds DRAM full evicts the chain's tail (leaves first).
    gone = [i for i, k in enumerate(keys) if MEDIUM_CPU not in held[k]]
    assert gone
    n = gone[0] + 1
    assert c.get(tokens[:n * BT], kv(n * BT)) == n * BT  # block gone[0] promoted back into DRAM
    wait_for(lambda: {MEDIUM_CPU, MEDIUM_STORAGE} == where(events_of(replay(daemon.replay))).get(keys[n - 1], set()),
             what="a promotion announced")

    def all_gone():
        c.delete(keys)  # again while the read lease, released in the background, still pins blocks
        return not set(keys) & set(where(events_of(replay(daemon.replay))))

    wait_for(all_gone, what="the deletes announced")
    removed = [e for e in events_of(replay(daemon.replay)) if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {MEDIUM_CPU, MEDIUM_STORAGE}
    c.close()


def test_a_subscriber_that_reconnects_gets_what_it_missed_by_replay(daemon):
    c = client(daemon, "reconnect")
    live = Live(daemon.pub)
    n = [0]

    def put_one() -> bytes:
        toks = list(range(n[0] * BT + 900_000, (n[0] + 1) * BT + 900_000))
        n[0] += 1
        c.put(toks, kv(BT))
        return c.keys(toks)[0]

    def seen(key):
        return [s for s, b in live.read() for e in b.events if isinstance(e, BlockStored) and key in e.block_hashes]

    # A new SUB socket joins a moment after connecting: publish until it hears one.
    last = wait_for(lambda: seen(put_one()), what="the subscriber to hear a store")[-1]
    live.close()
    missed = [put_one() for _ in range(3)]

    def stored_since(seq: int) -> set:
        return {k for e in events_of(replay(daemon.replay, seq)) if isinstance(e, BlockStored) for k in e.block_hashes}

    # Published before the subscriber is back (else they may share a batch with what it hears
    # first: the daemon batches events, and a fast host makes all of this one batch).
    wait_for(lambda: set(missed) <= stored_since(last + 1), what="the missed stores to be published")
    live = Live(daemon.pub)
    first = wait_for(lambda: seen(put_one()), what="the subscriber, reconnected, to hear a store")[0]
    assert first > last + 1  # it missed batches, and knows it by their numbers
    got = replay(daemon.replay, last + 1)
    assert [s for s, _ in got][:first - last] == list(range(last + 1, first + 1))  # no batch lost
    assert set(missed) <= {k for e in events_of(got) if isinstance(e, BlockStored) for k in e.block_hashes}
    live.close()
    c.close()


def test_a_snapshot_is_exactly_the_state_after_the_batches_numbered_before_it(daemon):
    c = client(daemon, "snap")
    tokens = list(range(7_000_000, 7_000_000 + 4 * BT))
    c.put(tokens, kv(len(tokens)))
    c.delete(c.keys(tokens)[2:])
    snap = ask(daemon.replay, b"kvstore-snapshot")
    s = snap[0][0]
    assert {seq for seq, _ in snap} == {s} and isinstance(snap[0][1].events[0], AllBlocksCleared)
    history = [(seq, b) for seq, b in replay(daemon.replay) if seq < s]
    assert [seq for seq, _ in history] == list(range(s))  # the whole history is still buffered
    assert where(events_of(snap)) == where(events_of(history))
    keys = c.keys(tokens)
    assert where(events_of(snap))[keys[0]] == {MEDIUM_CPU, MEDIUM_STORAGE} and keys[3] not in where(events_of(snap))
    c.close()


def test_the_hf_adapters_stores_carry_their_token_ids(daemon):
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    from kvstore.clients.hf import HFAdapter, HFAdapterConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from common import build_llama, random_tokens

    a = HFAdapter(KVStoreClient(daemon.socket_path, timeout_s=10), build_llama("tiny", "fp32", seed=0),
                  HFAdapterConfig("events-hf", block_tokens=BT))
    try:
        prompt = random_tokens(3 * BT + 4, seed=21, vocab=512)
        _, cache = a.prefill(prompt)
        assert cache.wait_stored() == 3
        e = cpu_store(daemon, cache.block_keys[0])
        assert e.block_hashes == cache.block_keys and e.token_ids == prompt[:3 * BT]
    finally:
        a.close()
        a.client.close()


def test_a_gpu_path_store_carries_its_token_ids(daemon):
    torch = pytest.importorskip("torch")
    from kvstore.clients.gpu import GpuKVPath

    c = client(daemon, "events-gpu")
    ids = list(range(40_000, 40_000 + 2 * BT + 3))
    caches = [torch.zeros(2, 8, BT, LAYOUT.num_kv_heads, LAYOUT.head_dim, dtype=torch.float16)
              for _ in range(LAYOUT.num_layers)]
    with GpuKVPath(c, caches) as path:
        assert path.emulated
        assert path.store(ids, [5, 2, 7]).commit(30) == 2
    keys = c.keys(ids)
    e = cpu_store(daemon, keys[0])
    assert e.block_hashes == keys and e.token_ids == ids[:2 * BT]
    c.close()


def test_blocks_that_arrive_by_transfer_carry_the_senders_token_ids(pair):
    a, b = pair
    ca = client(a, "shipped", salt="tenant-t")
    tokens = list(range(5_000_000, 5_000_000 + 5 * BT))
    keys = ca.keys(tokens)
    ca.put(tokens, kv(len(tokens)))
    assert ca.transfer(keys[2:], b.transfer_addr, deadline_s=20).blocks == 3  # the middle of a chain
    e = cpu_store(b, keys[2])
    assert e.block_hashes == keys[2:] and e.parent_block_hash == keys[1] and e.token_ids == tokens[2 * BT:]
    assert e.extra_keys == [("tenant-t",)] * 3
    # Pipelined (the vLLM connector's transfers): the reserved blocks' tokens travel the same way.
    cb = client(b, "shipped", salt="tenant-t")
    more = list(range(5_100_000, 5_100_000 + 2 * BT))
    w = ca.reserve(ca.keys(more), doorbell=True, token_ids=more)
    fut = ca.transfer(ca.keys(more), b.transfer_addr, deadline_s=20, lease=w, wait=False)
    inc = cb.await_transfer(ca.keys(more), wait_s=10)  # B has reserved them: it is pipelined
    w.ring(LAYOUT.num_layers)
    w.commit()
    assert fut.result().blocks == 2
    inc.release()
    assert cpu_store(b, ca.keys(more)[0]).token_ids == more
    cb.close()
    # A long transfer of 16-token blocks: 1,100 blocks, 70 KiB of token ids, past the header's
    # 64 KiB but within its 64 bytes per key: they travel, parent included.
    small = KVLayout(1, 1, 16, "fp16", block_tokens=16)
    cs = KVStoreClient(a.socket_path, timeout_s=20)
    cs.register(small, "shipped-many")
    many = list(range(7_000_000, 7_000_000 + 1101 * 16))
    cs.put(many, np.zeros(small.tensor_shape(len(many)), np.float16))
    keys_many = cs.keys(many)
    assert cs.transfer(keys_many[1:], b.transfer_addr, deadline_s=30).blocks == 1100
    wanted = set(keys_many[1:])

    def stored():  # announced in several BlockStored events: gathered in order
        evs = [e for e in events_of(replay(b.replay))
               if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU and e.block_hashes[0] in wanted]
        return evs if sum(len(e.block_hashes) for e in evs) >= 1100 else None
    evs = wait_for(stored, what="the 1,100 blocks announced")
    assert [h for e in evs for h in e.block_hashes] == keys_many[1:]
    assert [t for e in evs for t in e.token_ids] == many[16:] and evs[0].parent_block_hash == keys_many[0]
    cs.close()
    # Token ids past that (17 blocks of 1,024 tokens: 68 KiB, beyond 64 KiB + 17 x 64 bytes)
    # stay behind: the blocks arrive and are announced without them.
    big = KVLayout(1, 1, 16, "fp16", block_tokens=1024)
    cl = KVStoreClient(a.socket_path, timeout_s=10)
    cl.register(big, "shipped-long")
    long = list(range(17 * 1024))
    cl.put(long, np.zeros(big.tensor_shape(len(long)), np.float16))
    assert cl.transfer(cl.keys(long), b.transfer_addr, deadline_s=20).blocks == 17
    e = cpu_store(b, cl.keys(long)[0])
    assert len(e.block_hashes) == 17 and e.token_ids == []
    cl.close()
    ca.close()


def test_a_peers_token_ids_that_do_not_hash_to_the_keys_are_refused(pair):
    a, b = pair
    c = client(b, "forged")
    tokens = list(range(6_000_000, 6_000_000 + 2 * BT))
    keys = c.keys(tokens)
    blocks = [Block(k, b"", TierKind.DRAM, 0, parent_key=p, tokens=bytes(4 * BT)) for k, p in zip(keys, [None, *keys])]
    forged = transfer_meta.encode(c.namespace, blocks, 1 << 16)
    with Sender(TransferConfig(backend="tcp")) as s, pytest.raises(TransferError) as e:
        s.open(b.transfer_addr, keys, LAYOUT.num_layers, LAYOUT.layer_chunk_bytes, meta=forged, deadline_s=5)
    assert e.value.status is TransferStatus.PROTOCOL_ERROR and "do not hash to key 0" in e.value.detail, e.value
    assert c.lookup(tokens) == 0  # nothing reserved, nothing stored
    c.close()
