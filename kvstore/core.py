"""The daemon's state: namespaces, sessions, the block index, leases and eviction.

Single-threaded and plain: every method is called with ``Core.lock`` held (the gRPC servicer
takes it; background workers take it for their short metadata steps). Data never moves under
the lock except DRAM memcpy-speed copies the caller chose to make there.

Eviction is leaves-first LRU: the least recently used unpinned block that has no cached
children in its tier goes first. A miss is a normal answer; failures are :class:`KVError`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from kvstore.errors import Code, KVError, invalid, not_found
from kvstore.index import Block, BlockState, Lru
from kvstore.keys import KEY_BYTES, Namespace
from kvstore.leases import Lease, LeaseKind, LeaseOps
from kvstore.sessions import MAX_SESSIONS, Session, SessionEnd, SessionOps  # noqa: F401 - re-exported
from kvstore.tiers.base import TierKind
from kvstore.tiers.dram import DramTier
from kvstore.v1 import kvstore_pb2 as pb


@dataclass(slots=True, eq=False)
class NsState:
    ns: Namespace
    id: bytes
    block_bytes: int
    blocks: dict[bytes, Block] = field(default_factory=dict)
    sessions: int = 0
    prefill_tokens_per_s: float = 0.0
    model_params: float = 0.0
    cost: object = None  # the namespace's prefill cost model (kvstore.policy.PrefillCostModel)


def split_keys(packed: bytes, limit: int) -> list[bytes]:
    """Packed 32-byte keys -> list; INVALID_ARGUMENT on a bad length or over ``limit``."""
    if len(packed) % KEY_BYTES:
        raise invalid(f"keys: {len(packed)} bytes is not a whole number of {KEY_BYTES}-byte keys")
    n = len(packed) // KEY_BYTES
    if n > limit:
        raise invalid(f"keys: {n} keys exceed the limit of {limit} per request (server.max_keys_per_request)")
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


class Core(LeaseOps, SessionOps):
    def __init__(self, dram: DramTier, *, lease_ttl_s: float, session_ttl_s: float, max_keys: int, metrics=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.RLock()
        # Notified (under the lock) when blocks finish moving between tiers: demotions and
        # durable writes free DRAM, promotions land.
        self.changed = threading.Condition(self.lock)
        self.dram = dram
        self.lease_ttl_s = lease_ttl_s
        self.session_ttl_s = session_ttl_s
        self.max_keys = max_keys
        self.metrics = metrics
        self.clock = clock
        self.namespaces: dict[bytes, NsState] = {}
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()  # least recently heard from first
        self._ended: OrderedDict[bytes, tuple[SessionEnd, float]] = OrderedDict()  # recently ended: how, when
        self.leases: dict[int, Lease] = {}
        self._lrus: dict[tuple[TierKind, bytes], Lru] = {}  # per tier and namespace
        self.tick = 0  # recency counter behind every Block.tick
        self._lease_ids = itertools.count(1)
        self.evicted: list[bytes] = []  # recent DRAM evictions, oldest first (for tests and ls)
        # Hooks the tier movement layer sets: called with a DRAM block about to be dropped; it
        # returns True when the block's data was kept in a lower tier instead.
        self.on_evict: Callable[[Block], bool] | None = None
        # Set by tier movement: True for a block that must reach NVMe before DRAM may drop it.
        self.must_demote: Callable[[Block], bool] | None = None
        self.waiting_for_demotion = False
        self.demoting = 0  # blocks whose DRAM slot is being copied to NVMe right now
        self.demand_bytes = 0  # room the last reservation refused for demotion needed
        self.doorbells = None  # kvstore.doorbell.Doorbells, set by the daemon
        self.ns_quota_bytes = 0  # DRAM bytes one namespace may hold (0 = no quota)
        self.quota_hit = False
        # HBM residency (kvstore.hbm_cache): blocks read ``hot_after`` times queue up in ``hot``;
        # ``on_dram_free`` is told when a block's DRAM copy goes.
        self.hot_after = 0
        self.hot: list[Block] = []
        self.on_dram_free: Callable[[Block], None] | None = None
        self._passes: dict[bytes, object] | None = None  # open DRAM victim streams (eviction_pass)

    # --- sessions --------------------------------------------------------------------------
    def register(self, ns: Namespace, prefill_tokens_per_s: float = 0.0, model_params: float = 0.0) -> Session:
        block_bytes = ns.layout.block_bytes
        if not self.dram.fits(block_bytes):
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"layout: one block is {block_bytes} bytes, larger than a DRAM extent "
                          f"({self.dram.alloc.extent_bytes} bytes); lower block_tokens or raise dram.extent_bytes")
        self._check_room()
        st = self.namespaces.get(ns.root)
        if st is None:
            st = self.namespaces[ns.root] = NsState(ns, ns.root, block_bytes)
        if prefill_tokens_per_s > 0:
            st.prefill_tokens_per_s = prefill_tokens_per_s
        if model_params > 0:
            st.model_params = model_params
        return self._open_session(st)

    def _keys(self, packed: bytes) -> list[bytes]:
        return split_keys(packed, self.max_keys)

    # --- lookup ----------------------------------------------------------------------------
    def lookup(self, s: Session, packed: bytes) -> tuple[list[Block], bytes]:
        """The leading committed blocks of ``packed`` in this namespace, stopping at the first
        miss, and one tier byte per hit. The hot path of every request: kept lean."""
        get = s.ns.blocks.get
        committed = BlockState.COMMITTED
        hits: list[Block] = []
        append = hits.append
        for k in self._keys(packed):
            b = get(k)
            if b is None or b.state is not committed:
                break
            append(b)
        tick = self.tick + len(hits) + 1
        tiers = bytearray(len(hits))
        for i, b in enumerate(hits):  # root most recent: ancestors outlive their descendants
            tick -= 1
            b.tick = tick
            b.hits += 1
            tiers[i] = b.tier
        self.tick += len(hits)
        return hits, bytes(tiers)

    def lru(self, tier: TierKind, ns_id: bytes) -> Lru:
        lru = self._lrus.get((tier, ns_id))
        if lru is None:
            lru = self._lrus[(tier, ns_id)] = Lru()
        return lru

    def touch(self, b: Block) -> None:
        self.tick += 1
        b.tick = self.tick

    # --- write path ------------------------------------------------------------------------
    def reserve(self, s: Session, packed: bytes, parent: bytes, doorbell: bool = False
                ) -> tuple[Lease | None, list[int], bytes]:
        self._check_open(s)
        keys = self._keys(packed)
        if parent and len(parent) != KEY_BYTES:
            raise invalid(f"parent: must be empty or {KEY_BYTES} bytes, got {len(parent)}")
        ns = s.ns
        states = bytearray([pb.SLOT_RESERVED] * len(keys))
        todo = []
        seen = set()
        for i, k in enumerate(keys):
            if k in seen:
                raise invalid(f"keys: key {i} ({k.hex()[:16]}...) appears twice in one request")
            seen.add(k)
            b = ns.blocks.get(k)
            if b is None:
                todo.append(i)
            else:
                states[i] = pb.SLOT_PRESENT if b.state is BlockState.COMMITTED else pb.SLOT_BUSY
        most = self.dram.max_slots(ns.block_bytes)
        if len(todo) > most:
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"reservation of {len(todo)} blocks of {ns.block_bytes} bytes exceeds the DRAM tier, "
                          f"which holds at most {most} such blocks ({self.dram.capacity_bytes} bytes); "
                          "reserve in smaller batches")
        offsets = [0] * len(keys)
        if not todo:
            return None, offsets, bytes(states)
        lease = Lease(next(self._lease_ids), LeaseKind.WRITE, s, [], self.clock() + self.lease_ttl_s)
        self.quota_hit = False
        try:
            with self.eviction_pass():
                for i in todo:
                    off = self._allocate(ns)
                    if off is None and self.quota_hit:
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      f"namespace quota of {self.ns_quota_bytes} bytes in DRAM (dram.namespace_quota_bytes) "
                                      "is reached and none of this namespace's blocks can be evicted")
                    if off is None and (self.waiting_for_demotion or self.demoting):
                        self.waiting_for_demotion = True
                        self.demand_bytes = len(todo) * self.dram.slot_stride(ns.block_bytes)
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      "DRAM tier full while blocks are being demoted to NVMe; retry in a few milliseconds",
                                      transient=True, refusal=pb.REFUSAL_DRAM_DEMOTING)
                    if off is None:
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      f"DRAM tier full: {len(todo)} slots of {ns.block_bytes} bytes needed, "
                                      "every other block is pinned or being written; retry after releasing leases")
                    b = Block(keys[i], ns.id, TierKind.DRAM, off, lease_id=lease.id,
                              parent_key=keys[i - 1] if i else (parent or None))
                    ns.blocks[keys[i]] = b
                    lease.blocks.append(b)
                    offsets[i] = off
        except KVError:
            self._free_reserved(lease)
            raise
        # Slots freed by evicting a chain tail-first come back highest first: hand them out in
        # ascending order, so runs of neighbouring slots move in one copy (and one NVMe I/O).
        for b, off in zip(lease.blocks, sorted(b.offset for b in lease.blocks)):
            b.offset = off
        for i, b in zip(todo, lease.blocks):
            offsets[i] = b.offset
        self.demand_bytes = 0
        self.waiting_for_demotion = False
        if doorbell and self.doorbells is not None:
            lease.doorbell = self.doorbells.alloc()
        self.leases[lease.id] = lease
        s.leases[lease.id] = lease
        return lease, offsets, bytes(states)

    def _allocate(self, ns: NsState) -> int | None:
        quota = self.ns_quota_bytes
        if quota:  # over its quota a namespace makes room among its own blocks only
            stride = self.dram.slot_stride(ns.block_bytes)
            while self.dram.ns_bytes.get(ns.id, 0) + stride > quota:
                if not self._evict_one(ns, own_only=True):
                    self.quota_hit = True
                    return None
        off = self.dram.allocate(ns.id, ns.block_bytes)
        while off is None:
            if not self._evict_one(ns):
                return None
            off = self.dram.allocate(ns.id, ns.block_bytes)
        return off

    @contextmanager
    def eviction_pass(self):
        """Evictions inside (under one hold of the lock) share one pass over each namespace's
        DRAM LRU (``Lru.victims``): making room for n blocks at the end of an m-block chain costs
        O(m + n log m), where n single pops cost O(n m log m)."""
        if self._passes is not None:
            yield
            return
        self._passes = {}
        try:
            yield
        finally:
            streams, self._passes = self._passes, None
            for g in streams.values():
                g.close()

    @staticmethod
    def _dram_leaf(b: Block) -> bool:
        return not b.busy and not b.has_kids_in(TierKind.DRAM)

    def _dram_victim(self, ns_id: bytes) -> Block | None:
        """Pop ``ns_id``'s least recent evictable DRAM leaf, from the open pass if there is one."""
        if self._passes is None:
            return self.lru(TierKind.DRAM, ns_id).pop_victim(self._dram_leaf)
        g = self._passes.get(ns_id)
        if g is None:
            g = self._passes[ns_id] = self.lru(TierKind.DRAM, ns_id).victims(self._dram_leaf)
        return next(g, None)

    def _evict_one(self, ns: NsState, own_only: bool = False) -> bool:
        """Evict one DRAM block: this namespace's least recent leaf (its slots fit exactly),
        else the least recent leaf of the namespace whose LRU head is oldest, until one of
        that namespace's extents frees up."""
        tier = TierKind.DRAM
        victim = self._dram_victim(ns.id)
        if victim is None and not own_only:
            victim = self.pop_victim(tier, self._dram_leaf, exclude=ns.id, take=self._dram_victim)
        if victim is None:
            return False
        if self.must_demote is not None and self.must_demote(victim):
            # Its data would be lost: put it back and let the writer retry once the
            # background demotion has moved it (back-pressure, not loss).
            self.lru(tier, victim.ns_id).add(victim)
            self.waiting_for_demotion = True
            return False
        self._drop_from_dram(victim, "capacity")
        return True

    def pop_victim(self, tier: TierKind, ok: Callable[[Block], bool], prefer_ns: bytes | None = None,
                   exclude: bytes | None = None, take: Callable[[bytes], Block | None] | None = None
                   ) -> Block | None:
        """Remove from ``tier``'s LRUs and return the least recent block with ``ok(block)``:
        from ``prefer_ns`` first if given, else from the namespace (other than ``exclude``)
        whose oldest block is oldest. ``take(ns_id)``, if given, does the popping."""
        if prefer_ns is not None:
            victim = self.lru(tier, prefer_ns).pop_victim(ok)
            if victim is not None:
                return victim
        skip = prefer_ns or exclude
        heads = [(lru.peek_tick(), ns_id) for (t, ns_id), lru in self._lrus.items()
                 if t is tier and ns_id != skip and len(lru)]
        for _tick, ns_id in sorted(h for h in heads if h[0] is not None):
            victim = take(ns_id) if take is not None else self.lru(tier, ns_id).pop_victim(ok)
            if victim is not None:
                return victim
        return None

    def victims(self, tier: TierKind, ok: Callable[[Block], bool]):
        """Yield ``tier``'s blocks with ``ok(block)`` least recent first across namespaces, in
        one pass (``Lru.victims`` per namespace, merged by recency). Each yielded block is off
        its LRU, as with ``pop_victim``; close the generator (under the same hold of the lock)
        to put back the ones looked at and not taken."""
        streams, heads = {}, []
        try:
            for (t, ns_id), lru in list(self._lrus.items()):
                if t is tier and len(lru):
                    streams[ns_id] = lru.victims(ok)
                    b = next(streams[ns_id], None)
                    if b is not None:
                        heads.append((b.tick, ns_id, b))
            heapq.heapify(heads)
            while heads:
                _tick, ns_id, b = heapq.heappop(heads)
                yield b
                nxt = next(streams[ns_id], None)  # after the caller dealt with b
                if nxt is not None:
                    heapq.heappush(heads, (nxt.tick, ns_id, nxt))
        finally:
            for _tick, ns_id, b in heads:  # fetched, not taken: back on their LRU
                self.lru(tier, ns_id).add(b)
            for g in streams.values():
                g.close()

    def _drop_from_dram(self, b: Block, reason: str) -> None:
        kept = self.on_evict is not None and reason == "capacity" and self.on_evict(b)
        self.lru(TierKind.DRAM, b.ns_id).discard(b)
        if self.on_dram_free is not None:
            self.on_dram_free(b)
        self.dram.free(b.ns_id, b.offset)
        if kept:
            b.tier, b.offset = TierKind.NVME, -1
        else:
            self._forget(b)
        if reason == "capacity":
            self.evicted.append(b.key)
            del self.evicted[:-4096]
        if self.metrics:
            self.metrics.evictions.labels(tier="dram", reason=reason).inc()

    def _forget(self, b: Block) -> None:
        ns = self.namespaces.get(b.ns_id)
        if ns is not None and ns.blocks.get(b.key) is b:
            del ns.blocks[b.key]
        if b.parent is not None:
            b.parent.kids.discard(b)
        for k in b.kids:
            k.parent = None
        b.kids = set()
        b.state = BlockState.RESERVED

    def commit(self, s: Session, lease_id: int, packed: bytes) -> list[Block]:
        lease = self._lease(s, lease_id, LeaseKind.WRITE)
        if packed:
            wanted = self._keys(packed)
            by_key = {b.key: b for b in lease.blocks}
            missing = [k for k in wanted if k not in by_key]
            if missing:
                raise KVError(Code.FAILED_PRECONDITION,
                              f"commit: key {missing[0].hex()[:16]}... is not reserved under lease {lease_id}")
            chosen = [by_key[k] for k in wanted]
        else:
            chosen = list(lease.blocks)
        ns = s.ns
        lru = self.lru(TierKind.DRAM, ns.id)
        for b in chosen:
            b.state = BlockState.COMMITTED
            b.lease_id = 0
        for b in chosen:
            p = ns.blocks.get(b.parent_key) if b.parent_key else None
            if p is not None and p.state is BlockState.COMMITTED:
                b.parent = p
                p.kids.add(b)
            elif p is not None and p.lease_id == lease.id:
                lease.orphans[p.key] = b  # its parent is in a piece of this lease not committed yet
            kid = lease.orphans.pop(b.key, None)
            if kid is not None and kid.state is BlockState.COMMITTED and ns.blocks.get(kid.key) is kid:
                kid.parent = b
                b.kids.add(kid)
        for b in reversed(chosen):  # leaf first, then each parent: ancestors stay more recent
            self.touch(b)
            lru.add(b)
            if b.parent is not None:
                self.touch(b.parent)
        done = set(map(id, chosen))
        lease.blocks = [b for b in lease.blocks if id(b) not in done]
        if not lease.blocks:
            self._end_lease(lease)
        if self.metrics:
            self.metrics.blocks_committed.inc(len(chosen))
            self.metrics.bytes_written.inc(len(chosen) * ns.block_bytes)
        return chosen

    def abort(self, s: Session, lease_id: int) -> int:
        lease = self._lease(s, lease_id, LeaseKind.WRITE)
        n = self._free_reserved(lease)
        self._end_lease(lease)
        return n

    def _free_reserved(self, lease: Lease) -> int:
        n = 0
        for b in lease.blocks:
            if b.state is BlockState.RESERVED:
                if b.ref_cnt == 0:  # a reader of the incoming slot frees it when it lets go
                    self.dram.free(b.ns_id, b.offset)
                self._forget(b)
                n += 1
        lease.blocks = []
        return n

    # --- delete ----------------------------------------------------------------------------
    def delete(self, s: Session, packed: bytes) -> tuple[int, int]:
        """Delete committed blocks; pinned or moving ones are kept. Returns (deleted, busy)."""
        return self._delete_all([b for b in map(s.ns.blocks.get, self._keys(packed)) if b is not None])

    def _delete_all(self, blocks: list[Block]) -> tuple[int, int]:
        deleted = busy = 0
        for b in blocks:
            if b.state is not BlockState.COMMITTED:
                continue
            if b.ref_cnt or b.busy:
                busy += 1
                continue
            self._delete_block(b)
            deleted += 1
        return deleted, busy

    def _delete_block(self, b: Block) -> None:
        if b.on_nvme and self.on_delete is not None:
            self.on_delete(b)
        if b.tier is TierKind.DRAM:
            self._drop_from_dram(b, "delete")
        else:
            self._forget(b)

    on_delete: Callable[[Block], None] | None = None

    def drop_namespace(self, ns_id_hex: str) -> tuple[int, int]:
        text = ns_id_hex.lower()
        if len(text) < 8 or any(c not in "0123456789abcdef" for c in text):
            raise invalid("namespace: give the hex namespace id or a unique prefix of at least 8 hex digits")
        matches = [st for nid, st in self.namespaces.items() if nid.hex().startswith(text)]
        if not matches:
            raise not_found(f"namespace {ns_id_hex}: no such namespace")
        if len(matches) > 1:
            raise invalid(f"namespace {ns_id_hex}: prefix matches {len(matches)} namespaces; give more digits")
        return self._delete_all(list(matches[0].blocks.values()))

