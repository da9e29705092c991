"""KV events from a real daemon, read as a router reads vLLM's: decoded with vLLM's own
``KVEventBatch``, live on the PUB socket and through the replay socket, tier moves included."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from events_util import Live, ask, events_of, replay
from kvstore.clients import KVStoreClient
from kvstore.clients.leases import KVStoreError
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from wait_util import wait_for
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved, BlockStored

LAYOUT = KVLayout(4, 2, 64, "fp16", block_tokens=16)  # 32 KiB blocks
BT = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def daemon(module_daemons, tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    pub, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    proc = module_daemons("--events-publish", pub, "--events-replay", rep, "--dram-prefault", "false",
                          "--nvme-dir", str(d / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "64MiB",
                          "--nvme-durable-commit", "true", dram="8MiB")
    proc.pub, proc.replay = pub, rep
    return proc


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
    held = wait_for(lambda: (h := where(events_of(replay(daemon.replay)))) and MEDIUM_STORAGE in h.get(keys[-1], ())
                    and h, what="the last block announced on NVMe")
    assert all(MEDIUM_STORAGE in held[k] for k in keys)
    gone = [k for k in keys if MEDIUM_CPU not in held[k]]
    assert gone and gone[0] == keys[0]
    out = kv(2 * BT)
    assert c.get(tokens[:2 * BT], out) == 2 * BT  # promoted back into DRAM
    wait_for(lambda: {MEDIUM_CPU, MEDIUM_STORAGE} == where(events_of(replay(daemon.replay))).get(keys[1], set()),
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
