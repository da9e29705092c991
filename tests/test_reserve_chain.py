"""The client's one chain-reservation helper, against the real daemon: batches chained to the
key before them, token ids sliced per batch, and all-or-none."""

from __future__ import annotations

import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.tier_kind import TierKind

LAYOUT = KVLayout(2, 1, 64, "fp16", block_tokens=16)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("chain"), dram="16MiB")
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "chain")
    yield c
    c.close()
    assert d.stop() == 0


def test_batches_chain_to_the_key_before_them_and_carry_their_tokens(client):
    tokens = np.arange(8 * 16, dtype=np.int32)
    keys = client.keys(tokens)
    got = list(client.reserve_chain(keys, token_ids=tokens, batch_blocks=3))
    assert [start for start, _ in got] == [0, 3, 6]
    assert [w.keys for _, w in got] == [keys[0:3], keys[3:6], keys[6:8]]
    for _, w in got:
        w.commit()
    assert client.lookup_keys(keys).hit_blocks == 8  # one chain: every batch's parent was the key before it
    # A later start reserves only the tail, chained to the stored prefix.
    more = np.arange(10 * 16, dtype=np.int32)
    keys10 = client.keys(more)
    assert keys10[:8] == keys
    tail = list(client.reserve_chain(keys10, start=8, token_ids=more, batch_blocks=4))
    assert [(s, w.keys) for s, w in tail] == [(8, keys10[8:10])]
    tail[0][1].commit()
    assert client.lookup_keys(keys10).hit_blocks == 10


def test_reserve_all_aborts_the_batches_before_a_refused_one(client):
    keys = client.keys(np.arange(6 * 16, dtype=np.int32) + 5000)
    bad = keys[:3] + [keys[3], keys[3], keys[5]]  # the second batch names a key twice: refused
    def dram_used() -> int:
        (dram,) = [t for t in client.stats().tiers if t.tier == TierKind.DRAM]
        return dram.used_bytes

    used = dram_used()
    with pytest.raises(KVStoreError, match="appears twice"):
        client.reserve_all(bad, batch_blocks=3)
    assert dram_used() == used  # the first batch's slots were given back
    leases = client.reserve_all(keys, batch_blocks=3)  # and its keys are free to reserve again
    assert [len(w.keys) for w in leases] == [3, 3] and dram_used() == used + 6 * LAYOUT.block_bytes
    for w in leases:
        w.abort()
