"""What the core reports to its event stream (``BlockEvents``), in exact order, without a
process: commits, evictions for room, deletes, aborts and a lease that expires."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvstore.daemon.core import Core, CoreConfig
from kvstore.errors import Code, KVError
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.tiers.arena import Arena
from kvstore.tier_kind import TierKind
from kvstore.tiers.dram import DramTier

LAYOUT = KVLayout(2, 1, 64, "fp16", block_tokens=16)  # 8 KiB blocks
EXTENT = 16 * 4096  # 8 slots


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[str, bytes, TierKind]] = []

    def stored(self, b, ns, tier) -> None:
        self.log.append(("stored", b.key, tier))

    def removed(self, b, tier) -> None:
        self.log.append(("removed", b.key, tier))


def test_commit_eviction_delete_and_abort_are_reported_once_each_in_order():
    rec = Recorder()
    arena = Arena(EXTENT, prefault=False)
    try:
        core = Core(DramTier(arena, EXTENT), CoreConfig(max_keys=64), events=rec)
        s = core.register(Namespace("m", LAYOUT))
        root = s.ns.id
        a = chain_keys(root, [1] * 16 * 6, 16)
        b = chain_keys(root, [2] * 16 * 4, 16)
        lease, _, _ = core.reserve(s, b"".join(a), b"")
        assert rec.log == []  # reserved blocks are not announced
        core.commit(s, lease.id, b"")
        assert rec.log == [("stored", k, TierKind.DRAM) for k in a]
        rec.log.clear()
        lease, _, _ = core.reserve(s, b"".join(b), b"")  # 8 slots: a's two leaves make room
        assert rec.log == [("removed", a[5], TierKind.DRAM), ("removed", a[4], TierKind.DRAM)]
        rec.log.clear()
        core.abort(s, lease.id)
        assert rec.log == []
        core.delete(s, b"".join(a[:2]))
        assert rec.log == [("removed", a[0], TierKind.DRAM), ("removed", a[1], TierKind.DRAM)]
        rec.log.clear()
        core.delete(s, b"".join(a[:2]))  # already gone: nothing more to say
        assert rec.log == []
    finally:
        arena.close()


def test_no_events_collaborator_costs_nothing_and_announces_nothing():
    arena = Arena(EXTENT, prefault=False)
    try:
        core = Core(DramTier(arena, EXTENT), CoreConfig(max_keys=64))
        s = core.register(Namespace("m", LAYOUT))
        keys = chain_keys(hashlib.sha256(b"r").digest(), [3] * 32, 16)
        lease, _, _ = core.reserve(s, b"".join(keys), b"")
        core.commit(s, lease.id, b"")
        assert all(s.ns.blocks[k].announced == 0 for k in keys)
    finally:
        arena.close()


def test_token_ids_are_kept_only_by_a_core_with_an_event_stream():
    """Only the KV events read a block's token ids: without a stream the core keeps none (and
    the service hashes none), though a list of the wrong size is still refused."""
    toks = np.arange(32, dtype="<i4")
    for events, kept in ((Recorder(), [toks[:16].tobytes(), toks[16:].tobytes()]), (None, [None, None])):
        arena = Arena(EXTENT, prefault=False)
        try:
            core = Core(DramTier(arena, EXTENT), CoreConfig(max_keys=64), events=events)
            assert core.keeps_tokens is (events is not None)
            s = core.register(Namespace("m", LAYOUT))
            keys = chain_keys(s.ns.id, toks, 16)
            lease, _, _ = core.reserve(s, b"".join(keys), b"", tokens=toks.tobytes())
            assert [s.ns.blocks[k].tokens for k in keys] == kept
            with pytest.raises(KVError) as e:
                core.reserve(s, b"".join(chain_keys(s.ns.id, toks + 1, 16)), b"", tokens=toks[:20].tobytes())
            assert e.value.code is Code.INVALID_ARGUMENT and "token_ids: 80 bytes" in e.value.message
        finally:
            arena.close()
