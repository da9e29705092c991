"""Leases and the read path of the core: acquiring and pinning blocks, releasing them, keeping
leases alive and reclaiming the ones whose client died.

A mixin of :class:`kvstore.core.Core` (same single-threaded contract: call with ``Core.lock``
held); it only splits the core's code by responsibility.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import Code, KVError, not_found
from kvstore.index import Block, BlockState
from kvstore.tiers.base import TierKind

if TYPE_CHECKING:
    from kvstore.core import Session


class LeaseKind:
    WRITE = "write"
    READ = "read"


@dataclass(slots=True, eq=False)
class Lease:
    id: int
    kind: str
    session: "Session"
    blocks: list[Block]
    expires: float
    doorbell: int = 0  # arena offset of the lease's layer doorbell (write leases that asked)
    # Write leases committed in pieces: a committed block whose chain parent is still reserved
    # under this lease, by that parent's key; linked when the parent commits (pieces of one
    # lease may commit in any order).
    orphans: dict = field(default_factory=dict)


class LeaseOps:
    def _lease(self, s: Session, lease_id: int, kind: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise not_found(f"lease {lease_id}: unknown or expired (TTL {self.lease_ttl_s} s); "
                            "reserve or acquire again")
        if lease.session is not s:
            raise KVError(Code.PERMISSION_DENIED, f"lease {lease_id}: belongs to another session")
        if lease.kind != kind:
            raise KVError(Code.FAILED_PRECONDITION, f"lease {lease_id}: is a {lease.kind} lease, not a {kind} lease")
        return lease

    def _end_lease(self, lease: Lease) -> None:
        if lease.doorbell and self.leases.get(lease.id) is lease:
            self.doorbells.release(lease.doorbell)
        self.leases.pop(lease.id, None)
        lease.session.leases.pop(lease.id, None)

    # --- read path -------------------------------------------------------------------------
    def acquire(self, s: Session, packed: bytes, allow_partial: bool) -> tuple[Lease | None, list[Block]]:
        self._check_open(s)
        keys = self._keys(packed)
        blocks = []
        for i, k in enumerate(keys):
            b = s.ns.blocks.get(k)
            if b is None or b.tier is not TierKind.DRAM or b.state is not BlockState.COMMITTED:
                if allow_partial:
                    break
                if b is None:
                    raise not_found(f"key {i} ({k.hex()[:16]}...): no such block in this session's namespace")
                if b.state is not BlockState.COMMITTED:
                    raise KVError(Code.FAILED_PRECONDITION,
                                  f"key {i} ({k.hex()[:16]}...): reserved but not committed; it cannot be read yet")
                raise KVError(Code.FAILED_PRECONDITION,
                              f"key {i} ({k.hex()[:16]}...): not resident in DRAM ({b.tier.name}); prefetch it first")
            blocks.append(b)
        if not blocks:
            return None, []
        lease = Lease(next(self._lease_ids), LeaseKind.READ, s, blocks, self.clock() + self.lease_ttl_s)
        lru = self.lru(TierKind.DRAM, s.ns.id)
        hot_after = self.hot_after
        for b in reversed(blocks):
            self.touch(b)
            b.reads += 1
            if b.reads == hot_after:
                self.hot.append(b)
            if b.ref_cnt == 0:
                lru.discard(b)
            b.ref_cnt += 1
        self.leases[lease.id] = lease
        s.leases[lease.id] = lease
        return lease, blocks

    def pin(self, s: Session, blocks: list[Block]) -> Lease:
        """A read lease over blocks in any state (a decode worker reading slots that a transfer
        is still filling); their slots outlive a failed transfer until the lease ends."""
        self._check_open(s)
        lease = Lease(next(self._lease_ids), LeaseKind.READ, s, list(blocks), self.clock() + self.lease_ttl_s)
        for b in blocks:
            if b.ref_cnt == 0:
                self.lru(b.tier, b.ns_id).discard(b)
            b.ref_cnt += 1
        self.leases[lease.id] = lease
        s.leases[lease.id] = lease
        return lease

    def release(self, s: Session, lease_id: int) -> None:
        self._unpin(self._lease(s, lease_id, LeaseKind.READ))

    def _unpin(self, lease: Lease) -> None:
        for b in reversed(lease.blocks):
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.state is BlockState.COMMITTED and self.namespaces[b.ns_id].blocks.get(b.key) is b:
                    self.lru(b.tier, b.ns_id).add(b)
                else:
                    self._free_dropped(b)
        self._end_lease(lease)

    def _free_dropped(self, b: Block) -> None:
        """A block deleted while pinned: its slot is freed when the last reader lets go."""
        if b.tier is TierKind.DRAM and b.offset >= 0:
            if self.on_dram_free is not None:
                self.on_dram_free(b)
            self.dram.free(b.ns_id, b.offset)
            b.offset = -1

    def _drop_lease(self, lease: Lease) -> None:
        """End a lease whatever its kind: a write lease's uncommitted slots are freed, a read
        lease's blocks are unpinned."""
        if lease.kind == LeaseKind.WRITE:
            self._free_reserved(lease)
            self._end_lease(lease)
        else:
            self._unpin(lease)

    def keepalive(self, s: Session, lease_ids: list[int]) -> list[int]:
        expired = []
        until = self.clock() + self.lease_ttl_s
        for lid in lease_ids:
            lease = self.leases.get(lid)
            if lease is None or lease.session is not s:
                expired.append(lid)
            else:
                lease.expires = until
        return expired

    def expire(self) -> int:
        """Reclaim every lease past its TTL (a client that died mid-write or mid-read)."""
        now = self.clock()
        dead = [lease for lease in self.leases.values() if lease.expires <= now]
        for lease in dead:
            self._drop_lease(lease)
            if self.metrics:
                self.metrics.lease_expiries.labels(kind=lease.kind).inc()
        return len(dead)
