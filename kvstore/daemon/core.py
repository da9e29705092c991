"""The daemon's state: namespaces, sessions, the block index and the write and read protocol
(reserve, commit, acquire, release, delete), and what leases do to blocks (the table of them is
:mod:`kvstore.daemon.leases`).

Single-threaded and plain: every method is called with ``Core.lock`` held. The lock is taken at
the edges of the daemon, never inside the core: by the gRPC servicer (one hold per RPC's
metadata step) and by the transfer sides and the reaper for their short metadata steps.

Where a block lives is :class:`~kvstore.daemon.residency.Residency`'s (``Core.residency``; it
owns the lock the core shares): the core places a block when it reserves it and asks the
residency for everything else (slots, eviction, frees, NVMe copies). Tier movers work on the
residency, never on the core. See docs/architecture.md.

A miss is a normal answer; failures are :class:`KVError`.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kvstore.config import Config
from kvstore.doorbell import Doorbells
from kvstore.errors import Code, KVError, invalid, not_found
from kvstore.daemon.index import Block, BlockState, Lru, NsState, Parts
from kvstore.daemon.placement import QuotaFlag
from kvstore.daemon.residency import Residency
from kvstore.daemon.leases import Lease, LeaseKind, LeaseTable
from kvstore.daemon.seams import BlockEvents, LowerTiers
from kvstore.keys import KEY_BYTES, Namespace, check_token_count
from kvstore.daemon.sessions import Session, SessionEnd, SessionTable
from kvstore.tier_kind import TierKind
from kvstore.tiers.dram import DramTier
from kvstore.v1 import kvstore_pb2 as pb

DRAM, NVME = TierKind.DRAM, TierKind.NVME
MAX_PARTS = 256  # parts of one block (writers of one block: TP ranks)


@dataclass(slots=True)
class CoreConfig:
    lease_ttl_s: float = 30.0  # an unrenewed lease is reclaimed after this long (seconds)
    session_ttl_s: float = 60.0  # a session not heard from for this long is ended (seconds)
    max_keys: int = 8192  # keys per request
    ns_quota_bytes: int = 0  # DRAM bytes one namespace may hold (0 = no quota)
    hot_after_reads: int = 0  # Acquires after which a block is queued for an HBM copy (0 = never)

    @classmethod
    def from_config(cls, cfg: Config) -> "CoreConfig":
        s = cfg.server
        return cls(lease_ttl_s=s.lease_ttl_s, session_ttl_s=s.session_ttl_s, max_keys=s.max_keys_per_request,
                   ns_quota_bytes=cfg.dram.namespace_quota_bytes,
                   hot_after_reads=cfg.hbm.admit_reads if cfg.hbm.capacity_bytes else 0)


def split_keys(packed: bytes, limit: int) -> list[bytes]:
    """Packed 32-byte keys -> list; INVALID_ARGUMENT on a bad length or over ``limit``."""
    if len(packed) % KEY_BYTES:
        raise invalid(f"keys: {len(packed)} bytes is not a whole number of {KEY_BYTES}-byte keys")
    n = len(packed) // KEY_BYTES
    if n > limit:
        raise invalid(f"keys: {n} keys exceed the limit of {limit} per request (server.max_keys_per_request)")
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


class Core:
    def __init__(self, dram: DramTier, cfg: CoreConfig, *, lower: LowerTiers | None = None, hbm=None,
                 doorbells: Doorbells | None = None, metrics=None, events: BlockEvents | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # Where blocks live, and the daemon's one lock: see kvstore.daemon.residency.
        self.residency = res = Residency(dram, lower=lower, hbm=hbm, events=events, metrics=metrics,
                                         ns_quota_bytes=lambda: self.cfg.ns_quota_bytes)
        self.lock = res.lock
        self.changed = res.changed  # notified (under the lock) when moves land
        self.dram = dram
        self.cfg = cfg
        self.lower = res.lower
        self.doorbells = doorbells
        self.metrics = metrics
        # Token ids are for the KV events alone: a daemon without them neither hashes a
        # writer's token ids against its keys nor keeps them (about 100 bytes a block).
        self.keeps_tokens = events is not None
        self.clock = clock
        self.namespaces: dict[bytes, NsState] = res.namespaces
        self.sessions = SessionTable(cfg.session_ttl_s, clock)
        self.leases = LeaseTable(cfg.lease_ttl_s, clock, doorbells)
        self.lrus = res.lrus
        self._own_ids = itertools.count(1)
        # Blocks reserved in parts and not yet whole (by id): one whose writers all committed
        # with a part still missing has no lease left to end it; expire() drops it at its deadline.
        self.partial: dict[int, Block] = {}
        self.writes_refused = ""  # why new blocks are refused (draining before a shutdown); "" = taken

    @property
    def pressure(self):
        """DRAM back-pressure (read-only here: :class:`Residency` writes it)."""
        return self.residency.pressure

    def configure(self, cfg: CoreConfig) -> None:
        """Apply a reloaded config (SIGHUP): TTLs and limits take effect on the next call."""
        self.cfg = cfg
        self.sessions.ttl_s = cfg.session_ttl_s
        self.leases.ttl_s = cfg.lease_ttl_s

    # --- namespaces and sessions -----------------------------------------------------------
    def ns_state(self, ns: Namespace) -> NsState:
        """The namespace's state, created on first use (Register, an incoming transfer, NVMe
        recovery)."""
        return self.residency.ns_state(ns)

    def register(self, ns: Namespace, prefill_tokens_per_s: float = 0.0, model_params: float = 0.0) -> Session:
        block_bytes = ns.layout.block_bytes
        if not self.dram.fits(block_bytes):
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"layout: one block is {block_bytes} bytes, larger than a DRAM extent "
                          f"({self.dram.extent_bytes} bytes); lower block_tokens or raise dram.extent_bytes")
        st = self.namespaces.get(ns.root) or NsState(ns, ns.root, block_bytes)
        s = self.sessions.open(st)  # RESOURCE_EXHAUSTED when the table is full: nothing created
        self.namespaces[ns.root] = st
        if prefill_tokens_per_s > 0:
            st.prefill_tokens_per_s = prefill_tokens_per_s
        if model_params > 0:
            st.model_params = model_params
        return s

    def own_session(self, st: NsState) -> Session:
        """A session of the daemon's own in ``st`` (an incoming transfer's): not in the session
        table, so it never expires and no client can name it; its leases end with its work."""
        return Session(b"daemon:" + next(self._own_ids).to_bytes(8, "big"), st, seen=self.clock())

    def session(self, sid: bytes) -> Session:
        """The open session ``sid``, renewed (NOT_FOUND with the reason if it is unknown)."""
        return self.sessions.get(sid)

    def close_session(self, s: Session, how: SessionEnd) -> int:
        """End ``s`` and every lease it holds: write leases are aborted (their uncommitted slots
        freed), read leases released (their blocks evictable again). Returns leases ended."""
        leases = list(s.leases.values())
        for lease in leases:
            self._drop_lease(lease)
        self.sessions.end(s, how)
        if self.metrics:
            self.metrics.session_ends.labels(reason=how.value).inc()
        return len(leases)

    def expire_sessions(self, limit: int) -> int:
        """End at most ``limit`` sessions not heard from for ``session_ttl_s`` seconds, oldest
        first; returns how many (``limit`` means there may be more: call again, having let go of
        the lock in between so that RPCs are not held up behind a mass expiry)."""
        n = 0
        while n < limit:
            s = self.sessions.oldest_expired()
            if s is None:
                break
            self.close_session(s, SessionEnd.EXPIRED)
            n += 1
        return n

    def keys(self, packed: bytes) -> list[bytes]:
        """A request's packed keys, checked against ``max_keys``."""
        return split_keys(packed, self.cfg.max_keys)

    # --- lookup ----------------------------------------------------------------------------
    def lookup(self, s: Session, packed: bytes, each: bool = False) -> tuple[list[Block], bytes, bytes]:
        """The leading committed blocks of ``packed`` in this namespace, stopping at the first
        miss, one tier byte per hit, and ``b""``. The hot path of every request: kept lean.
        ``each``: every key on its own (a miss does not end the answer); the third item then
        has one byte per key, 1 where it was found."""
        get = s.ns.blocks.get
        committed = BlockState.COMMITTED
        hits: list[Block] = []
        found = b""
        if each:
            blocks = [get(k) for k in self.keys(packed)]
            have = [b is not None and b.state is committed for b in blocks]
            hits, found = [b for b, h in zip(blocks, have) if h], bytes(have)
        else:
            append = hits.append
            for k in self.keys(packed):
                b = get(k)
                if b is None or b.state is not committed:
                    break
                append(b)
        res = self.residency
        tick = res.tick + len(hits) + 1
        tiers = bytearray(len(hits))
        for i, b in enumerate(hits):  # root most recent: ancestors outlive their descendants
            tick -= 1
            b.tick = tick
            b.hits += 1
            tiers[i] = b.tier
        res.tick += len(hits)
        return hits, bytes(tiers), found

    def lru(self, tier: TierKind, ns_id: bytes) -> Lru:
        return self.residency.lru(tier, ns_id)

    def touch(self, b: Block) -> None:
        self.residency.touch(b)

    def announce(self, b: Block) -> None:
        """Tell the event stream which tiers ``b`` is in now (see :meth:`Residency.announce`)."""
        self.residency.announce(b)

    # --- write path ------------------------------------------------------------------------
    def reserve(self, s: Session, packed: bytes, parent: bytes, doorbell: bool = False, tokens: bytes = b"",
                part: int = 0, parts: int = 0) -> tuple[Lease | None, list[int], bytes]:
        """Slots for the new keys of ``packed``. ``tokens``: the keys' token ids (int32 LE,
        ``block_tokens`` per key) or empty; kept with each block for the KV events when
        :attr:`keeps_tokens` (the caller has then checked them against the keys), else only
        their size is checked. ``part`` of ``parts`` (``parts`` > 1): this lease writes one
        part of each block; a block another writer placed for its part of the same ``parts``
        is joined (its slot comes back RESERVED), and it becomes visible once every part is
        committed (:class:`~kvstore.daemon.index.Parts`)."""
        self.sessions.check_open(s)
        if self.writes_refused:
            raise KVError(Code.UNAVAILABLE, self.writes_refused)
        keys = self.keys(packed)
        if parent and len(parent) != KEY_BYTES:
            raise invalid(f"parent: must be empty or {KEY_BYTES} bytes, got {len(parent)}")
        if parent and parent in keys:
            raise invalid("parent: is one of the keys reserved; a block cannot be its own ancestor")
        parts = parts or 1
        if parts > MAX_PARTS or part >= parts:
            raise invalid(f"part: {part} of {parts} parts; a block has at most {MAX_PARTS} parts, numbered from 0")
        if parts > 1 and doorbell:
            raise invalid("doorbell: a block written in parts has no layer doorbell (its layers are ready only "
                          "when every part is committed)")
        ns = s.ns
        if tokens:
            try:
                check_token_count(len(keys), tokens, ns.ns.layout.block_tokens)
            except ValueError as e:
                raise invalid(str(e)) from None
            if not self.keeps_tokens:
                tokens = b""
        states = bytearray([pb.SLOT_RESERVED] * len(keys))
        todo, joins = [], []
        seen = set()
        for i, k in enumerate(keys):
            if k in seen:
                raise invalid(f"keys: key {i} ({k.hex()[:16]}...) appears twice in one request")
            seen.add(k)
            b = ns.blocks.get(k)
            if b is None:
                todo.append(i)
            elif b.state is BlockState.COMMITTED:
                states[i] = pb.SLOT_PRESENT
            elif parts > 1 and b.parts is not None and b.parts.count == parts and not b.parts.holds(part):
                joins.append(i)
            else:
                states[i] = pb.SLOT_BUSY
        most = self.dram.max_slots(ns.block_bytes)
        if len(todo) > most:
            raise KVError(Code.RESOURCE_EXHAUSTED,
                          f"reservation of {len(todo)} blocks of {ns.block_bytes} bytes exceeds the DRAM tier, "
                          f"which holds at most {most} such blocks ({self.dram.capacity_bytes} bytes); "
                          "reserve in smaller batches")
        offsets = [0] * len(keys)
        if not todo and not joins:
            return None, offsets, bytes(states)
        step = 4 * ns.ns.layout.block_tokens
        lease = self.leases.new(LeaseKind.WRITE, s, [])
        if parts > 1:
            lease.part = part
        quota = QuotaFlag()
        try:
            with self.residency.eviction_pass():
                for i in todo:
                    off = self.residency.allocate_slot(ns, quota)
                    if off is None and quota.hit:
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      f"namespace quota of {self.cfg.ns_quota_bytes} bytes in DRAM (dram.namespace_quota_bytes) "
                                      "is reached and none of this namespace's blocks can be evicted")
                    if off is None and self.residency.refuse_for_room(len(todo) * self.dram.slot_stride(ns.block_bytes),
                                                                      ns.id, ns.block_bytes):
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      "DRAM tier full while blocks are being demoted to NVMe; retry in a few milliseconds",
                                      transient=True, refusal=pb.REFUSAL_DRAM_DEMOTING)
                    if off is None:
                        raise KVError(Code.RESOURCE_EXHAUSTED,
                                      f"DRAM tier full: {len(todo)} slots of {ns.block_bytes} bytes needed, "
                                      "every other block is pinned or being written; retry after releasing leases")
                    b = Block(keys[i], ns.id, TierKind.DRAM, off, lease_id=lease.id,
                              parent_key=keys[i - 1] if i else (parent or None))
                    if parts > 1:
                        b.parts = Parts(parts, {part: lease.id}, lease.expires)
                        self.partial[id(b)] = b
                    if tokens:
                        b.tokens = tokens[i * step:(i + 1) * step]
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
        for i in joins:  # another writer's slot: this lease fills its own part of it
            b = ns.blocks[keys[i]]
            b.parts.writers[part] = lease.id
            b.parts.deadline = max(b.parts.deadline, lease.expires)
            lease.blocks.append(b)
            offsets[i] = b.offset
        self.residency.room_found()
        if doorbell and self.doorbells is not None:
            lease.doorbell = self.doorbells.alloc()
        self.leases.add(lease)
        return lease, offsets, bytes(states)

    def allocate_slot(self, ns: NsState) -> int | None:
        """A DRAM slot for one of ``ns``'s blocks (see :meth:`Residency.allocate_slot`)."""
        return self.residency.allocate_slot(ns)

    def dram_only_chains(self) -> list[Block]:
        """See :meth:`Residency.dram_only_chains`."""
        return self.residency.dram_only_chains()

    def commit(self, s: Session, lease_id: int, packed: bytes) -> list[Block]:
        lease = self.lease(s, lease_id, LeaseKind.WRITE)
        if packed:
            wanted = self.keys(packed)
            if len(set(wanted)) != len(wanted):
                raise invalid("keys: a key appears twice in one commit")
            by_key = {b.key: b for b in lease.blocks}
            missing = [k for k in wanted if k not in by_key]
            if missing:
                raise KVError(Code.FAILED_PRECONDITION,
                              f"commit: key {missing[0].hex()[:16]}... is not reserved under lease {lease_id}")
            chosen = [by_key[k] for k in wanted]
        else:
            chosen = list(lease.blocks)
        ns = s.ns
        if lease.part >= 0:
            picked = set(map(id, chosen))
            lease.blocks = [b for b in lease.blocks if id(b) not in picked]
            chosen = self._parts_done(lease, chosen)
        lru = self.lru(TierKind.DRAM, ns.id)
        waiting = [(b, b.parts.kids) for b in chosen if b.parts is not None and b.parts.kids]
        for b in chosen:
            b.state = BlockState.COMMITTED
            b.lease_id = 0
            b.parts = None
        for b in chosen:
            p = ns.blocks.get(b.parent_key) if b.parent_key else None
            if p is not None and p.state is BlockState.COMMITTED:
                b.parent = p
                p.kids.add(b)
            elif p is not None and p.parts is not None:
                p.parts.kids.append(b)  # its parent is written in parts, not whole yet
            elif p is not None and p.lease_id == lease.id:
                lease.orphans[p.key] = b  # its parent is in a piece of this lease not committed yet
            kid = lease.orphans.pop(b.key, None)
            if kid is not None and kid.state is BlockState.COMMITTED and ns.blocks.get(kid.key) is kid:
                kid.parent = b
                b.kids.add(kid)
        for b, kids in waiting:  # children committed before this parent's last part
            for kid in kids:
                if kid.state is BlockState.COMMITTED and kid.parent is None and ns.blocks.get(kid.key) is kid:
                    kid.parent = b
                    b.kids.add(kid)
        for b in reversed(chosen):  # leaf first, then each parent: ancestors stay more recent
            self.touch(b)
            if b.ref_cnt == 0:  # a block read while it was written (a transfer) is filed when let go
                lru.add(b)
            if b.parent is not None:
                self.touch(b.parent)
        for b in chosen:  # in chain order: a router's tree gets each parent before its children
            self.announce(b)
        done = set(map(id, chosen))
        lease.blocks = [b for b in lease.blocks if id(b) not in done]
        if not lease.blocks:
            self.leases.end(lease)
        if self.metrics:
            self.metrics.blocks_committed.inc(len(chosen))
            self.metrics.bytes_written.inc(len(chosen) * ns.block_bytes)
        return chosen

    def _parts_done(self, lease: Lease, blocks: list[Block]) -> list[Block]:
        """``lease``'s part of ``blocks`` is committed: the blocks whose every part is now
        committed, to publish. A block given up meanwhile (another part aborted) frees its slot
        when its last writer is done."""
        whole = []
        for b in blocks:
            p = b.parts
            p.writers.pop(lease.part, None)
            if p.failed:
                if not p.writers:
                    self._drop_partial(b)
                continue
            p.done |= 1 << lease.part
            if p.complete:
                self.partial.pop(id(b), None)
                whole.append(b)
            else:
                p.deadline = max(p.deadline, self.clock() + self.cfg.lease_ttl_s)
        return whole

    def _drop_partial(self, b: Block) -> None:
        """A block written in parts that will not be whole: out of the index, its slot freed
        (no writer is left to write into it)."""
        self.partial.pop(id(b), None)
        b.parts.failed = True
        self.residency.free_reserved(b)

    def _reap_partial(self) -> int:
        """Drop the blocks written in parts whose writers are all gone with a part still
        missing, once their deadline passed (a rank that never reserved its part)."""
        now = self.clock()
        dead = [b for b in self.partial.values() if not b.parts.writers and b.parts.deadline <= now]
        for b in dead:
            self._drop_partial(b)
        return len(dead)

    def abort(self, s: Session, lease_id: int) -> int:
        lease = self.lease(s, lease_id, LeaseKind.WRITE)
        n = self._free_reserved(lease)
        self.leases.end(lease)
        return n

    def _free_reserved(self, lease: Lease) -> int:
        n = 0
        for b in lease.blocks:
            if b.state is not BlockState.RESERVED:
                continue
            p = b.parts
            if p is not None:
                # One part given up: the block is a miss from now on (out of the index, so a
                # new writer starts afresh); its slot goes once no other part writes into it.
                p.writers.pop(lease.part, None)
                p.failed = True
                self.residency.forget(b)
                if p.writers:
                    continue
                self.partial.pop(id(b), None)
            self.residency.free_reserved(b)
            n += 1
        lease.blocks = []
        return n

    # --- read path -------------------------------------------------------------------------
    def lease(self, s: Session, lease_id: int, kind: str) -> Lease:
        """``s``'s open lease ``lease_id`` of ``kind`` (NOT_FOUND, PERMISSION_DENIED or
        FAILED_PRECONDITION otherwise)."""
        return self.leases.get(s, lease_id, kind)

    def acquire(self, s: Session, packed: bytes, allow_partial: bool, found: bytearray | None = None
                ) -> tuple[Lease | None, list[Block]]:
        """Pin the leading committed DRAM blocks of ``packed`` (all of them, or with
        ``allow_partial`` up to the first that is not). With ``found`` (a bytearray): each key on
        its own instead, every one held in DRAM pinned and ``found`` set to one byte per key."""
        self.sessions.check_open(s)
        keys = self.keys(packed)
        blocks = []
        if found is not None:
            found[:] = bytes(len(keys))
        for i, k in enumerate(keys):
            b = s.ns.blocks.get(k)
            if b is None or b.tier is not DRAM or b.state is not BlockState.COMMITTED:
                if found is not None:
                    continue
                if allow_partial:
                    break
                if b is None:
                    raise not_found(f"key {i} ({k.hex()[:16]}...): no such block in this session's namespace")
                if b.state is not BlockState.COMMITTED:
                    raise KVError(Code.FAILED_PRECONDITION,
                                  f"key {i} ({k.hex()[:16]}...): reserved but not committed; it cannot be read yet")
                raise KVError(Code.FAILED_PRECONDITION,
                              f"key {i} ({k.hex()[:16]}...): not resident in DRAM ({b.tier.name}); prefetch it first")
            if found is not None:
                found[i] = 1
            blocks.append(b)
        if not blocks:
            return None, []
        hot_after, res = self.cfg.hot_after_reads, self.residency
        for b in reversed(blocks):
            res.touch(b)
            res.note_read(b, hot_after)
            res.pin(b)
        return self.leases.open(LeaseKind.READ, s, blocks), blocks

    def pin(self, s: Session, blocks: list[Block]) -> Lease:
        """A read lease over blocks in any state (a decode worker reading slots that a transfer
        is still filling); their slots outlive a failed transfer until the lease ends."""
        self.sessions.check_open(s)
        for b in blocks:
            self.residency.pin(b)
        return self.leases.open(LeaseKind.READ, s, list(blocks))

    def release(self, s: Session, lease_id: int) -> None:
        self._unpin(self.lease(s, lease_id, LeaseKind.READ))

    def _unpin(self, lease: Lease) -> None:
        for b in reversed(lease.blocks):
            self.residency.unpin(b)
        self.leases.end(lease)

    def _drop_lease(self, lease: Lease) -> None:
        """End a lease whatever its kind: a write lease's uncommitted slots are freed, a read
        lease's blocks are unpinned."""
        if lease.kind == LeaseKind.WRITE:
            self._free_reserved(lease)
            self.leases.end(lease)
        else:
            self._unpin(lease)

    def keepalive(self, s: Session, lease_ids: list[int]) -> list[int]:
        """Renew ``s``'s leases; returns the ids that were not open (expired or ended)."""
        return self.leases.renew(s, lease_ids)

    def expire(self) -> int:
        """Reclaim every lease past its TTL (a client that died mid-write or mid-read)."""
        dead = self.leases.expired()
        for lease in dead:
            self._drop_lease(lease)
            if self.metrics:
                self.metrics.lease_expiries.labels(kind=lease.kind).inc()
        return len(dead) + (self._reap_partial() if self.partial else 0)

    # --- delete ----------------------------------------------------------------------------
    def delete(self, s: Session, packed: bytes) -> tuple[int, int]:
        """Delete committed blocks; pinned or moving ones are kept. Returns (deleted, busy)."""
        return self._delete_all([b for b in map(s.ns.blocks.get, self.keys(packed)) if b is not None])

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
        res = self.residency
        res.drop_nvme_copy(b)
        if b.tier is DRAM:
            res.drop_from_dram(b)
        else:
            res.forget(b)

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

