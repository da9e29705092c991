"""Tier movement between DRAM and NVMe: background demotion between watermarks, promotion on
read, prefetch with deadlines, restart recovery, and optional durable commits.

A block can live in DRAM, on NVMe, or both (``Block.on_nvme``: an NVMe copy exists, so dropping
the DRAM copy loses nothing). Metadata changes happen under ``Core.lock``; the I/O itself runs
on the NVMe tier's threads with the lock released. A block whose slot is being copied is
``busy``: it can still be read where it is, but it is neither evicted nor deleted until the copy
ends, so a slot is never reused under an I/O.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field

from kvstore.config import DramConfig, NvmeConfig
from kvstore.daemon.core import Core, NsState
from kvstore.daemon.seams import DramOnly
from kvstore.errors import Code, KVError
from kvstore.daemon.index import Block, BlockState
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.ns_file import NamespaceFile
from kvstore.policy import LoadPolicy
from kvstore.tiers.base import KeyedTier, TierKind
from kvstore.tiers.nvme import IoResult
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.daemon.tiering")
NVME, DRAM = TierKind.NVME, TierKind.DRAM
MAX_PREFETCHES = 4096
FLUSH_BATCH_BYTES = 64 << 20  # one put (and one index transaction) of the shutdown write-out


@dataclass(eq=False)
class Prefetch:
    id: int
    session_id: bytes
    keys: list[bytes]
    started: float  # Tiering's clock (seconds)
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    missed: bool = False
    failed: str = ""


class NvmeCopies(DramOnly):
    """The NVMe side of :class:`kvstore.daemon.seams.LowerTiers`: what the core asks about NVMe copies
    when it evicts or deletes (under the core lock). Built before the core; wakes the demoter
    through ``kick`` and never calls the core."""

    def __init__(self, nvme: KeyedTier, cfg: NvmeConfig) -> None:
        self.nvme = nvme
        self.cfg = cfg
        self.kick = threading.Event()  # set: the demoter should run a round now

    def holds_copy(self, b: Block) -> bool:
        return self.nvme.enabled

    def admits(self, b: Block) -> bool:
        """NVMe admission: looked up ``admit_after_hits`` times, or the head of children that are
        on NVMe or on their way there (dropping it would strand them there, unreachable)."""
        return b.hits >= self.cfg.admit_after_hits or any(k.on_nvme or k.busy for k in b.kids)

    def must_demote(self, b: Block) -> bool:
        if b.on_nvme or not self.nvme.enabled or not self.admits(b):
            return False
        self.kick.set()
        return True

    def delete_copy(self, b: Block) -> None:
        try:
            self.nvme.delete([b.key])
        except Exception as e:  # noqa: BLE001 - the tier disables itself; DRAM keeps serving
            log.error("NVMe delete failed: %s", e)


class Tiering:
    """The demoter thread, promotions and prefetches between the core's DRAM tier and NVMe.

    ``clock`` (seconds, monotonic) gives prefetch and make-resident deadlines; waits for a
    promotion to land are real-time condition waits, each bounded by the time left on that
    clock. Measured I/O durations stay on ``time.perf_counter``: they feed the load policy's
    bandwidth estimate, which must be the disk's real speed (a stopped test clock would report
    zero seconds)."""

    def __init__(self, core: Core, copies: NvmeCopies, cfg: NvmeConfig, dram_cfg: DramConfig, *,
                 metrics: Metrics, policy: LoadPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.clock = clock
        self.nvme = copies.nvme
        self.cfg = cfg
        self.dram_cfg = dram_cfg  # the demotion watermarks
        self.metrics = metrics
        self.policy = policy
        self.kick = copies.kick
        self.admits = copies.admits
        self.stopping = threading.Event()
        self.changed = self.core.changed  # notified when demotions, durable writes and promotions land
        self.prefetches: dict[int, Prefetch] = {}
        self.draining = False  # demoting: went over the high watermark, not yet under the low one
        self._ids = itertools.count(1)
        self.ns_file = NamespaceFile(self.nvme.dir)
        self.thread = threading.Thread(target=self._demote_loop, name="demoter", daemon=True)
        self._writer: threading.Thread | None = None  # write_out started by a drain

    # --- restart ----------------------------------------------------------------------------
    def recover(self) -> int:
        """Rebuild the index of every block the NVMe tier holds; returns blocks recovered."""
        core = self.core
        for ns in self.ns_file.read():
            core.ns_state(ns)
        entries = sorted(self.nvme.entries(), key=lambda e: e.atime)
        orphans, n = [], 0
        with core.lock:
            for e in entries:
                st = core.namespaces.get(e.ns_id)
                if st is None or e.nbytes != st.block_bytes:
                    orphans.append(e.key)
                    continue
                core.add_recovered(st, e.key, e.parent)
                n += 1
            lost = core.link_recovered()
            # Re-file in recency order now that parents are linked.
            for e in entries:
                st = core.namespaces.get(e.ns_id)
                b = st.blocks.get(e.key) if st else None
                if b is not None:
                    core.lru(NVME, e.ns_id).add(b)
        if orphans:
            log.warning("dropping %d NVMe blocks of namespaces this daemon cannot describe", len(orphans))
            self.nvme.delete(orphans)
        if lost:
            log.warning("reclaiming %d NVMe blocks unreachable by a prefix read (their chain's head is gone)", len(lost))
            self.nvme.delete([b.key for b in lost])
        return n - len(lost)

    def remember(self, st: NsState) -> None:
        """Persist a namespace's description so its NVMe blocks are recovered after a restart
        (OSError if the file cannot be written; the next Register tries again)."""
        self.ns_file.remember(st.ns)

    # --- demotion ---------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def _demote_loop(self) -> None:
        while not self.stopping.is_set():
            self.kick.wait(0.05)
            self.kick.clear()
            try:
                self.run_round()
            except Exception:  # noqa: BLE001 - keep the daemon serving from DRAM
                log.exception("demotion round failed")

    def run_round(self) -> int:
        """What the demoter does each time it wakes: if the NVMe tier disabled itself, forget
        the blocks only it held; else demote batches until DRAM is under the low watermark (or
        nothing more can move). Returns the batches run."""
        if not self.nvme.enabled:
            self._nvme_lost()
            return 0
        n = 0
        while not self.stopping.is_set() and self._demote_round():
            n += 1
        return n

    def _pick(self, want_bytes: int) -> list[Block]:
        """Least recent DRAM leaves across namespaces, up to ``want_bytes`` (under the lock). A
        parent whose DRAM children are all picked in this round counts as a leaf: the whole run
        goes to NVMe together, so leaves-first order still holds."""
        core, picked, got = self.core, [], 0
        chosen: set[int] = set()

        def ok(b: Block) -> bool:
            return not b.busy and all(k.tier is not DRAM or id(k) in chosen for k in b.kids)

        if want_bytes <= 0:
            return picked
        with closing(core.lrus.victims(DRAM, ok)) as stream:
            for b in stream:
                picked.append(b)
                chosen.add(id(b))
                got += core.dram.slot_stride(core.namespaces[b.ns_id].block_bytes)
                if got >= want_bytes:
                    break
        return picked

    def _demote_round(self) -> bool:
        """One batch of demotions. Starts above the high watermark (or when a writer waits for
        room) and keeps going until usage is under the low watermark and the waiting writer's
        reservation fits."""
        core, dram = self.core, self.core.dram
        with core.lock:
            used, cap = dram.used_bytes, dram.capacity_bytes
            if used > self.dram_cfg.demote_high_watermark * cap or core.pressure.waiting:
                self.draining = True
            want = max(used - int(self.dram_cfg.demote_low_watermark * cap), core.pressure.demand_bytes - (cap - used))
            if not self.draining or want <= 0:
                log.debug("demotion idle: used %d of %d, demand %d", used, cap, core.pressure.demand_bytes)
                self.draining = False
                core.pressure.waiting = False
                return False
            victims = self._pick(min(want, 256 << 20))
            if not victims:
                log.debug("demotion wants %d bytes but finds no unpinned leaf", want)
                return False
            items, moving = [], []
            for b in victims:
                st = core.namespaces[b.ns_id]
                if b.on_nvme:
                    core.evict_from_dram(b)  # a copy is there already: just move
                elif not self.admits(b):
                    core.evict_from_dram(b)  # not admitted to NVMe
                else:
                    b.busy = True
                    moving.append(b)
                    items.append((b.ns_id, b.key, b.parent_key, st.ns.layout.layer_chunk_bytes,
                                  dram.view(b.offset, st.block_bytes), b.digests))
            core.pressure.moving += len(moving)
        if not items:
            return True
        t0 = time.perf_counter()
        batch = self._put(items)
        sums = batch.digests() if batch is not None else {}
        with core.lock:
            core.pressure.moving -= len(moving)
            no_space = False
            for b in moving:
                b.busy = False
                b.keep_digests(sums.get(b.key))
                outcome = batch.results.get(b.key) if batch else IoResult.FAILED
                live = core.namespaces[b.ns_id].blocks.get(b.key) is b and b.state is BlockState.COMMITTED
                if outcome in (IoResult.OK, IoResult.PRESENT) and live:
                    b.on_nvme = True
                    core.announce(b)
                    if b.ref_cnt == 0:
                        core.evict_from_dram(b)  # kept: becomes an NVMe block
                        self.metrics.demotions.labels(src="dram", dst="nvme").inc()
                elif outcome in (IoResult.OK, IoResult.PRESENT):
                    self._delete_nvme([b.key])  # deleted while it was being written
                    core.free_dropped(b)
                else:
                    no_space |= outcome is IoResult.NO_SPACE
                    if live and b.ref_cnt == 0:
                        core.lru(DRAM, b.ns_id).add(b)
                    elif not live:
                        core.free_dropped(b)
            if no_space:
                self._evict_nvme(len(moving))
            self._enforce_nvme_quota({b.ns_id for b in moving})
            self._drive_prefetches()
            self.changed.notify_all()
        if batch is not None and batch.nbytes:
            self.policy.observe("nvme", batch.nbytes, time.perf_counter() - t0)
        log.debug("demoted %d blocks in %.4f s (%s)", len(moving), time.perf_counter() - t0,
                  "ok" if batch is not None and batch.error is None else batch.error if batch else "tier off")
        return True

    def _put(self, items):
        batch = self._submit(items)
        if batch is not None:
            self._wait(batch, len(items))
        return batch

    def _submit(self, items):
        try:
            return self.nvme.put_many(items)
        except Exception as e:  # noqa: BLE001 - disabled tier: DRAM keeps serving
            log.error("NVMe put failed: %s", e)
            return None

    def _wait(self, batch, n: int) -> None:
        if not batch.wait(self.cfg.io_timeout_s):
            log.error("NVMe put of %d blocks still running after its bound", n)
            batch.wait()  # the slots are under I/O: they must not be reused until it ends

    def _delete_nvme(self, keys: list[bytes]) -> None:
        try:
            self.nvme.delete(keys)
        except Exception as e:  # noqa: BLE001
            log.error("NVMe delete failed: %s", e)

    def _evict_nvme(self, count: int, ns_id: bytes | None = None) -> None:
        """Drop ``count`` least recent NVMe leaves (of ``ns_id`` only, if given) (under the lock)."""
        core, dropped = self.core, []

        def ok(b: Block) -> bool:
            return not b.busy and not any(k.on_nvme for k in b.kids)

        stream = core.lru(NVME, ns_id).victims(ok) if ns_id else core.lrus.victims(NVME, ok)
        with closing(stream):
            for b in itertools.islice(stream, count):
                b.on_nvme = False
                core.announce(b)
                dropped.append(b.key)
                if b.tier is NVME:
                    core.forget(b)
                self.metrics.evictions.labels(tier="nvme", reason="capacity").inc()
        if dropped:
            self._delete_nvme(dropped)

    def _enforce_nvme_quota(self, ns_ids) -> None:
        """A namespace over ``nvme.namespace_quota_bytes`` drops its own least recent NVMe leaves."""
        quota = self.cfg.namespace_quota_bytes
        if not quota:
            return
        for ns_id in ns_ids:
            st = self.core.namespaces.get(ns_id)
            if st is not None:
                over = len(self.core.lru(NVME, ns_id)) - quota // st.block_bytes
                if over > 0:
                    self._evict_nvme(over, ns_id)

    def _nvme_lost(self) -> None:
        """The tier disabled itself: forget blocks that only it held (never serve them)."""
        with self.core.lock:
            for st in self.core.namespaces.values():
                for b in [b for b in st.blocks.values() if b.on_nvme]:
                    self.core.lose_nvme_copy(b)
                    if b.tier is NVME and not b.busy:
                        self.core.forget(b)

    # --- durable commit ---------------------------------------------------------------------
    def committed(self, blocks: list[Block]) -> None:
        """Blocks were just committed to DRAM: with ``nvme.durable_commit`` write them through
        before the Commit is answered; either way wake the demoter."""
        if self.cfg.durable_commit:
            self.persist(blocks)
        self.kick.set()

    def persist(self, blocks: list[Block]) -> None:
        """Write committed DRAM blocks through to NVMe before the commit is acknowledged."""
        written, batch = self._write_through(blocks)
        if written and (batch is None or batch.error is not None):
            raise KVError(Code.UNAVAILABLE, f"commit: blocks are in DRAM but not durable on NVMe: "
                                            f"{batch.error if batch else 'NVMe tier disabled'}")

    def _write_through(self, blocks: list[Block]):
        """Copy committed DRAM blocks to NVMe, keeping their DRAM copies, and wait; returns
        (blocks it tried, the batch or None when the tier is off)."""
        todo, batch = self._start_copy(blocks)
        if batch is not None:
            self._wait(batch, len(todo))
        self._copied(todo, batch)
        return todo, batch

    def _start_copy(self, blocks: list[Block]):
        """Start copying the DRAM-only ones of ``blocks`` to NVMe (marked busy until
        :meth:`_copied`); returns (those blocks, the batch, or None when the tier is off)."""
        core = self.core
        with core.lock:
            todo = [b for b in blocks if b.tier is DRAM and not b.on_nvme and not b.busy]
            for b in todo:
                b.busy = True
            core.pressure.moving += len(todo)
            items = [(b.ns_id, b.key, b.parent_key, core.namespaces[b.ns_id].ns.layout.layer_chunk_bytes,
                      core.dram.view(b.offset, core.namespaces[b.ns_id].block_bytes), b.digests) for b in todo]
        return todo, self._submit(items) if items else None

    def _copied(self, todo: list[Block], batch) -> None:
        """The copy :meth:`_start_copy` started has ended: blocks it wrote have an NVMe copy."""
        core = self.core
        sums = batch.digests() if batch is not None else {}
        with core.lock:
            core.pressure.moving -= len(todo)
            for b in todo:
                b.busy = False
                b.keep_digests(sums.get(b.key))
                if batch is not None and batch.results.get(b.key) in (IoResult.OK, IoResult.PRESENT):
                    core.note_nvme_copy(b)
            self._enforce_nvme_quota({b.ns_id for b in todo})
            self.changed.notify_all()

    # --- promotion and prefetch -------------------------------------------------------------
    def promote(self, st: NsState, keys: list[bytes]) -> int:
        """Start moving the leading NVMe-only blocks of ``keys`` into DRAM; returns how many
        leading blocks are resident or on their way. Called under the lock."""
        core, want, slots = self.core, [], []
        n = 0
        with core.eviction_pass():
            for k in keys:
                b = st.blocks.get(k)
                if b is None or b.state is not BlockState.COMMITTED:
                    break
                n += 1
                if b.tier is NVME and not b.busy:
                    off = core.allocate_slot(st)
                    if off is None:
                        break
                    b.busy = True
                    want.append(b)
                    slots.append(off)
        if want:
            dsts = [core.dram.view(off, st.block_bytes) for off in slots]
            t0 = time.perf_counter()
            try:
                self.nvme.get_many([b.key for b in want], dsts,
                                   on_done=lambda batch: self._promoted(st, want, slots, batch, t0))
            except Exception as e:  # noqa: BLE001 - disabled tier: the blocks are gone
                log.error("NVMe read failed: %s", e)
                for b, off in zip(want, slots):
                    core.dram.free(st.id, off)
                    b.busy = False
                self._nvme_lost()
        return n

    def _promoted(self, st: NsState, blocks: list[Block], slots: list[int], batch, t0: float) -> None:
        core = self.core
        sums = batch.digests()
        with core.lock:
            for b, off in zip(blocks, slots):
                b.busy = False
                ok = batch.results.get(b.key) is IoResult.OK
                live = st.blocks.get(b.key) is b
                if ok and live:
                    b.tier, b.offset = DRAM, off
                    core.announce(b)
                    b.keep_digests(sums.get(b.key))
                    core.touch(b)
                    core.lru(DRAM, st.id).add(b)
                    self.metrics.promotions.labels(src="nvme", dst="dram").inc()
                else:
                    core.dram.free(st.id, off)
                    if live:  # corrupt or lost on disk: never served
                        core.lose_nvme_copy(b)
                        core.forget(b)
            self.changed.notify_all()
        if batch.nbytes:
            self.policy.observe("nvme", batch.nbytes, time.perf_counter() - t0)

    def _resident(self, st: NsState, keys: list[bytes]) -> tuple[int, bool]:
        """(leading blocks resident in DRAM, whether more may still arrive: the next one is on
        NVMe, being read or waiting for DRAM room)."""
        n = 0
        for k in keys:
            b = st.blocks.get(k)
            if b is None or b.state is not BlockState.COMMITTED:
                return n, False
            if b.tier is not DRAM:
                return n, self.nvme.enabled
            n += 1
        return n, False

    def make_resident(self, session, keys: list[bytes], wait_s: float, wanted: Callable[[], bool] = lambda: True) -> None:
        """Promote the leading NVMe blocks of ``keys`` and wait until they are in DRAM, or until
        ``wait_s`` seconds have passed on the clock; ``wanted`` (the call's ``is_active``) is
        asked every 50 ms, so a call whose client gave up ends then."""
        deadline = self.clock() + wait_s
        with self.core.lock:
            while True:
                self.promote(session.ns, keys)  # idempotent: blocks under way are skipped
                _, pending = self._resident(session.ns, keys)
                left = deadline - self.clock()
                if not pending or left <= 0 or not wanted():
                    return
                self.changed.wait(min(left, 0.05))

    def prefetch(self, session, keys: list[bytes], deadline_s: float) -> int:
        now = self.clock()
        p = Prefetch(next(self._ids), session.id, keys, now, now + (deadline_s or self.cfg.prefetch_deadline_s))
        with self.core.lock:
            self.promote(session.ns, keys)
            self.prefetches[p.id] = p
            while len(self.prefetches) > MAX_PREFETCHES:
                self.prefetches.pop(next(iter(self.prefetches)))
        return p.id

    def prefetch_status(self, session, handle: int, wait_s: float, wanted: Callable[[], bool] = lambda: True):
        """The prefetch's state, after waiting at most ``wait_s`` for it to finish; ``wanted``
        as for :meth:`make_resident`."""
        with self.core.lock:
            p = self.prefetches.get(handle)
            if p is None or p.session_id != session.id:
                raise KVError(Code.NOT_FOUND, f"prefetch {handle}: unknown handle for this session")
            until = min(self.clock() + wait_s, p.deadline)
            while True:
                self.promote(session.ns, p.keys)
                ready, pending = self._resident(session.ns, p.keys)
                now = self.clock()
                if not pending or now >= until or not wanted():
                    break
                self.changed.wait(min(until - now, 0.05))
            total = len(p.keys)
            if ready == total:
                if not p.done.is_set():
                    p.done.set()
                    self.metrics.prefetch_latency.observe(now - p.started)
                return pb.PREFETCH_DONE, ready, total, "all blocks resident in DRAM"
            if pending and now < p.deadline:
                return pb.PREFETCH_RUNNING, ready, total, f"{ready} of {total} leading blocks resident"
            if pending and not p.missed:
                p.missed = True
                self.metrics.prefetch_deadline_misses.inc()
            why = "deadline passed" if pending else "a block is missing or failed its checksum"
            return pb.PREFETCH_PARTIAL, ready, total, f"{why}: {ready} of {total} leading blocks usable; recompute the rest"

    def _drive_prefetches(self) -> None:
        """Demotion made room: push live prefetches on (under the lock)."""
        now = self.clock()
        for p in list(self.prefetches.values()):
            if not p.done.is_set() and now < p.deadline:
                s = self.core.sessions.find(p.session_id)
                if s is not None:
                    self.promote(s.ns, p.keys)

    # --- shutdown ---------------------------------------------------------------------------
    def close(self, deadline: float) -> None:
        """Shut down by ``deadline`` (``time.monotonic()``): stop demoting, write what only DRAM
        holds to NVMe (see :meth:`write_out`), save recency, commit and close the tier. Call
        once nothing writes any more (the RPC server and the transfer listener are stopped)."""
        self.stopping.set()
        self.kick.set()
        if self.thread.ident is not None:  # started (a Tiering driven by run_round never is)
            self.thread.join(max(0.0, deadline - time.monotonic()))
        if self._writer is not None:  # a drain's write-out: it stops at its next batch
            self._writer.join(max(0.0, deadline - time.monotonic()))
        self.write_out(deadline)
        self._save_recency()
        self.nvme.close()

    def start_write_out(self) -> None:
        """Drain before a shutdown: write DRAM out in the background (:meth:`write_out`) while
        reads go on, until done or :meth:`close`; the shutdown then has less to write."""
        if self._writer is None and not self.stopping.is_set():
            self._writer = threading.Thread(target=self.write_out, args=(float("inf"), self.stopping),
                                            name="write-out", daemon=True)
            self._writer.start()

    def write_out(self, deadline: float, cancel: threading.Event | None = None) -> int:
        """Copy DRAM-only blocks to NVMe until ``deadline``, heads of chains before their tails
        and most recent first (:meth:`Core.dram_only_chains`), in batches of ``FLUSH_BATCH_BYTES``
        (each committed to the index in one transaction), two in flight, so that however far it
        gets, the next start recovers prefixes (a child whose parent's batch had not landed is
        reclaimed at that start). Stops early once ``cancel`` is set. Returns blocks written."""
        if not self.nvme.enabled:
            return 0
        t0 = time.monotonic()
        with self.core.lock:
            order = self.core.dram_only_chains()
        total, written, failed = len(order), 0, set()
        stride = max(1, FLUSH_BATCH_BYTES // max((self.core.namespaces[b.ns_id].block_bytes for b in order), default=1))
        flying: list[tuple[list[Block], object]] = []
        i, why = 0, "done"

        def land() -> bool:
            """Wait for the oldest batch in flight; False if it did not end in time."""
            nonlocal written, why
            todo, batch = flying[0]
            if cancel is not None:
                self._wait(batch, len(todo))
            elif not batch.wait(max(0.0, deadline - time.monotonic())):
                why = "shutdown grace spent (batches in flight complete while the tier closes)"
                return False
            flying.pop(0)
            self._copied(todo, batch)
            ok = {k for k, r in batch.results.items() if r in (IoResult.OK, IoResult.PRESENT)}
            written += len(ok)
            failed.update(id(b) for b in todo if b.key not in ok)
            if any(r is IoResult.NO_SPACE for r in batch.results.values()):
                why = "NVMe tier full"
            return True

        while i < total and why == "done":
            if deadline - time.monotonic() <= 0:
                why = "shutdown grace spent"
                break
            if cancel is not None and cancel.is_set():
                why = "the shutdown takes over"
                break
            chunk = []
            for b in order[i:i + stride]:
                if b.parent is not None and id(b.parent) in failed:
                    failed.add(id(b))  # its parent did not make it: it would be unreachable
                else:
                    chunk.append(b)
            i += stride
            todo, batch = self._start_copy(chunk)
            if todo and batch is None:
                why = "NVMe tier disabled"
                self._copied(todo, None)
                break
            if todo:
                flying.append((todo, batch))
            if len(flying) == 2 and not land():
                break
        while flying and land():
            pass
        log.info("%d of %d DRAM-only blocks written to NVMe %s in %.3f s (%s)", written, total,
                 "while draining" if cancel is not None else "at shutdown", time.monotonic() - t0, why)
        return written

    def _save_recency(self) -> None:
        """Give every NVMe block an access time in the order of its recency here (lookups and
        reads of its DRAM copy included), so the next start rebuilds the same LRU order rather
        than the order of NVMe writes and reads alone. The times are spaced by 1 us up to now."""
        if not self.nvme.enabled:
            return
        with self.core.lock:
            blocks = sorted((b for st in self.core.namespaces.values() for b in st.blocks.values() if b.on_nvme),
                            key=lambda b: b.tick)
        now, n = time.time(), len(blocks)
        try:
            self.nvme.set_atimes((b.key, now - (n - i) * 1e-6) for i, b in enumerate(blocks))
        except Exception as e:  # noqa: BLE001 - the index keeps write times; nothing is lost
            log.error("NVMe access times not saved: %s", e)
