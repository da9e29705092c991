"""The fleet's prefix directory on a Redis-protocol cluster (Redis 7, Valkey): ``cluster.directory
= "redis"``. Each daemon writes its own blocks there and reads the store on a Lookup, so what a
daemon holds for the directory is its own blocks' roots, not the fleet's index: its memory and
CPU stay flat as nodes are added (docs/cluster.md has the figures).

Layout (``P`` = ``cluster.redis_key_prefix``):

- ``P{<tag>}<key>``: a hash per block, one field per node holding it, ``node_id -> b"epoch:bits"``
  (bits: ``1 << TierKind`` of its tiers). ``<tag>`` is the hex of the first 8 bytes of the key
  that starts the block's stretch of the chain: blocks ``0..63`` of a chain are tagged by block
  0, ``64..127`` by block 64, and so on (:data:`STRETCH`). A stretch is one shard, so a Lookup
  reads a prefix with one script call per stretch (:data:`READ`, which stops at the first block
  nobody holds, and answers one string per node). Tagging by the chain's first block alone
  would put every conversation under one system prompt on one shard (the measured hot spot,
  docs/cluster.md); by stretch, only the prompt's own first stretch is shared, and a daemon
  that holds a prefix reads only the stretches after it.
- ``P:o{<node>}:<epoch>``: the set of entry names a node wrote under that epoch, and
  ``P:e{<node>}`` the epochs that have such a set: what a sweep removes when the node leaves or
  comes back under a new epoch.

Correctness does not rest on the sweeps: a reader keeps only entries at the epoch membership
(etcd) has their node at, so a dead node's or an old epoch's blocks are never advised, and an
entry seen at an older epoch is deleted then and there (conditionally: a newer one stays).

Writes are batched and pipelined by the ``cluster-directory-writer`` thread; the core only queues
(it calls :meth:`RedisDirectory.stored` / :meth:`RedisDirectory.removed` under its lock). A store
that is down or slow costs a Lookup at most ``cluster.redis_timeout_s`` once, then nothing for
``cluster.redis_retry_s``: the Lookup answers with local hits only and the daemon keeps serving.
Once the store answers again the writer rewrites every entry of this node (it cannot know which
of its writes landed)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Callable

from kvstore import kv_events as ev
from kvstore.cluster.directory import _BEST, _BIT, _SPEED, DEFAULT_LIMIT, PrefixHit
from kvstore.cluster.member import Change
from kvstore.cluster.redis_store import DROP_OLD, READ, close_client, connect
from kvstore.config import ClusterConfig

log = logging.getLogger("kvstore.cluster")

STRETCH = 64  # blocks of a chain under one hash tag
_TIER_BITS = sum(_BIT.values())  # the bits an entry may carry: HBM, DRAM, NVMe
BATCH = 512  # commands per pipeline
SWEEP_LOCK_S = 600  # one daemon sweeps a departed registration; its lock lapses after this
# Own-map bytes per block (dict slot, key, tag and tuple): 249-336 measured by `kvstore bench
# cluster-sim --backend redis` with tracemalloc (docs/cluster.md); ops' size estimate.
BYTES_PER_OWN_BLOCK = 280


class RedisDirectory:
    """This daemon's part of the directory in the store: the writer of its own blocks (a
    :class:`kvstore.daemon.seams.BlockEvents`) and the reader Lookups and pulls ask
    (:meth:`longest_prefix`, as :class:`kvstore.cluster.stream.ClusterDirectory` answers it).
    ``connect_fn(timeout_s)`` makes a client (:func:`kvstore.cluster.redis_store.connect` by
    default); ``clock`` is monotonic seconds."""

    def __init__(self, cfg: ClusterConfig, *, password: str | None, metrics=None,
                 connect_fn: Callable | None = None, clock=time.monotonic) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.clock = clock
        self._connect = connect_fn or (lambda timeout_s: connect(cfg, password, timeout_s))
        self.prefix = cfg.redis_key_prefix.encode()
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._lost = 0
        self.max_pending = 200_000
        # key -> (its stretch's tag, None: no prefix here reaches it; tier bits; place in its stretch)
        self.own: dict[bytes, tuple[bytes | None, int, int]] = {}
        self._dirty: set[bytes] = set()
        self._entries = 0  # keys of ``own`` with a tag and a tier: this node's entries in the store
        self._orphans: dict[bytes, list[bytes]] = {}  # a parent not held yet -> its children held
        self._written_epoch = 0  # the epoch every entry of ``own`` is in the store at (0: not all)
        self._reader = self._writer = None
        self._reader_lock = threading.Lock()
        self._dropping = threading.Lock()  # one stale-entry deleter at a time
        self._writer_lock = threading.Lock()
        self._reader_down_until = 0.0
        self._writer_down_until = 0.0
        self.errors = 0
        self.node_id = ""
        self.membership = None
        self._source = None
        self._events: queue.SimpleQueue | None = None
        self._event = None  # the membership change being swept
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="cluster-directory-writer", daemon=True)

    # --- names ------------------------------------------------------------------------------
    def entry_name(self, tag: bytes, key: bytes) -> bytes:
        """The hash of block ``key``, in the stretch that block ``tag`` starts (its first 8 bytes count)."""
        return self.prefix + b"{" + tag[:8].hex().encode() + b"}" + key

    def _owned(self, node_id: str, epoch: int) -> bytes:
        return self.prefix + b":o{" + node_id.encode() + b"}:" + str(epoch).encode()

    def _epochs(self, node_id: str) -> bytes:
        return self.prefix + b":e{" + node_id.encode() + b"}"

    # --- BlockEvents (under the core lock: only queues) -------------------------------------
    def stored(self, b, ns, tier) -> None:
        self._add((b.key, b.parent_key, 1 << tier, True))

    def removed(self, b, tier) -> None:
        self._add((b.key, None, 1 << tier, False))

    def _add(self, item: tuple) -> None:
        with self._lock:
            if len(self._pending) < self.max_pending:
                self._pending.append(item)
            else:
                self._lost += 1

    def _cut(self) -> tuple[list[tuple], int]:
        with self._lock:
            items, self._pending = self._pending, []
            lost, self._lost = self._lost, 0
            return items, lost

    # --- lifecycle --------------------------------------------------------------------------
    def start(self, membership, source) -> None:
        """``membership``: this daemon's (node id, epoch, the live view); ``source``: the core's
        state (:class:`kvstore.daemon.events.CoreState`), taken now and again after lost events."""
        self.membership = membership
        self.node_id = membership.node_id
        self._source = source
        self._events = membership.subscribe()
        self._take_state()
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(5.0)
        with self._reader_lock:
            reader, self._reader = self._reader, None
        with self._writer_lock:
            writer, self._writer = self._writer, None
        close_client(reader)
        close_client(writer)

    def _take_state(self) -> None:
        """Rebuild ``own`` from every block the core holds (at start, and after lost events)."""
        items, (pending, lost) = self._source.capture(self._cut)
        parents: dict[bytes, bytes | None] = {}
        bits: dict[bytes, int] = {}
        for medium, key, parent, *_ in items:
            parents[key] = parent
            bits[key] = bits.get(key, 0) | (1 << ev.TIER_OF_MEDIUM[medium])
        depth: dict[bytes, int | None] = {}  # a block's place in its chain; None: its chain is not whole here
        for key in parents:  # walking up to the first block whose place is known, or the chain's first
            path, on_path, k = [], set(), key
            while k not in depth:
                path.append(k)
                on_path.add(k)
                p = parents[k]
                if p is None:  # k is a chain's first block
                    d = -1
                    break
                if p not in parents or p in on_path:  # its parent is not held here (or a client's
                    d = None                           # parents loop): no prefix of this node reaches it
                    break
                k = p
            else:
                d = depth[k]
            for q in reversed(path):
                d = None if d is None else d + 1
                depth[q] = d
        tags: dict[bytes, bytes | None] = {}
        for key in sorted(parents, key=lambda k: -1 if depth[k] is None else depth[k]):
            d = depth[key]
            tags[key] = None if d is None else key[:8] if d % STRETCH == 0 else tags[parents[key]]
        own = {k: (tags[k], bits[k], depth[k] % STRETCH if depth[k] is not None else 0) for k in parents}
        # What the store may hold of blocks no longer here (their removals were among the lost
        # events): written as deletions with the rest.
        for k, (tag, _, pos) in self.own.items():
            if k not in own and tag is not None:
                own[k] = (tag, 0, pos)
        self.own = own
        self._orphans = {}
        for k, p in parents.items():  # untagged blocks wait for their parent's tag
            if tags[k] is None and p is not None:
                self._orphans.setdefault(p, []).append(k)
        self._entries = sum(1 for t in tags.values() if t is not None)
        self._written_epoch = 0  # every entry is written again
        self._dirty = set()
        self._apply(pending)
        if lost:
            self._take_state()

    def _apply(self, items: list[tuple]) -> None:
        """Queued changes into ``own``; what changed is written at the next step. A block whose
        parent is not held here gets no tag (no prefix of this node reaches it) and no entry."""
        own, dirty = self.own, self._dirty
        for key, parent, bit, is_store in items:
            cur = own.get(key)
            if is_store:
                if cur is None:
                    if parent is None:
                        tag, pos = key[:8], 0
                    else:
                        ptag, _, ppos = own.get(parent, (None, 0, 0))
                        pos = (ppos + 1) % STRETCH
                        tag = None if ptag is None else key[:8] if pos == 0 else ptag
                        if ptag is None:  # committed before its parent: tagged when the parent is
                            self._orphans.setdefault(parent, []).append(key)
                    own[key] = (tag, bit, pos)
                    self._entries += tag is not None
                    if tag is not None and key in self._orphans:
                        self._adopt(key)
                elif cur[1] & bit:
                    continue
                else:
                    own[key] = (cur[0], cur[1] | bit, cur[2])
                    self._entries += not cur[1] and cur[0] is not None  # a deletion not yet written, undone
            else:
                if cur is None or not cur[1] & bit:
                    continue
                own[key] = (cur[0], cur[1] & ~bit, cur[2])
                self._entries -= not own[key][1] and cur[0] is not None
            if own[key][0] is not None:
                dirty.add(key)
            elif not own[key][1]:
                del own[key]

    def _adopt(self, key: bytes) -> None:
        """``key`` got its tag: so do the blocks committed before it below it (depth first)."""
        own, todo = self.own, [key]
        while todo:
            parent = todo.pop()
            ptag, _, ppos = own[parent]
            for child in self._orphans.pop(parent, ()):
                cur = own.get(child)
                if cur is None or cur[0] is not None:
                    continue
                pos = (ppos + 1) % STRETCH
                own[child] = (child[:8] if pos == 0 else ptag, cur[1], pos)
                if cur[1]:
                    self._entries += 1
                    self._dirty.add(child)
                todo.append(child)

    # --- the writer thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopping.wait(0.02):
            try:
                self._step()
            except Exception:  # noqa: BLE001 - the directory is advice: the cache goes on serving
                log.exception("cluster directory writer")
                self.stopping.wait(0.5)
        try:
            self._step()  # what is queued goes out before a clean stop
        except Exception:  # noqa: BLE001
            pass

    def _step(self) -> None:
        if self._reader is None and self.clock() >= self._reader_down_until:
            try:
                self._reader_client()  # Lookups read with it once it is up
            except Exception as e:  # noqa: BLE001 - a store down: Lookups give local hits only
                self._reader_failed(e)
        items, lost = self._cut()
        self._apply(items)
        if lost:
            log.warning("cluster directory: %d block changes dropped (queue full); taking the state again", lost)
            self._take_state()
        epoch = self.membership.epoch
        if not epoch or self.clock() < self._writer_down_until:
            return
        try:
            w = self._writer_client()
            if epoch != self._written_epoch:
                self._write_all(w, epoch)
            elif self._dirty:
                keys, self._dirty = self._dirty, set()
                try:
                    self._write(w, epoch, keys)
                except BaseException:
                    self._written_epoch = 0  # unknown what landed: all again, once it answers
                    raise
            self._sweeps(w)
        except Exception as e:  # noqa: BLE001 - redis.RedisError and socket errors: retry later
            self._failed("writer", e)
            self._writer_down_until = self.clock() + max(self.cfg.redis_retry_s, 0.1)
            with self._writer_lock:
                old, self._writer = self._writer, None
            close_client(old)

    def _writer_client(self):
        """The client of writes, sweeps and deletions (longer deadlines than a Lookup's; its own
        lock, so that a Lookup never waits on its connect)."""
        with self._writer_lock:
            if self._writer is None:
                self._writer = self._connect(max(2.0, self.cfg.redis_timeout_s))
            return self._writer

    def _write_all(self, w, epoch: int) -> None:
        """Every entry of this node under ``epoch``, then the sets of older epochs swept."""
        self._dirty = set()
        self._written_epoch = 0
        self._write(w, epoch, list(self.own))
        self._written_epoch = epoch
        olds = [int(e) for e in w.smembers(self._epochs(self.node_id)) if int(e) != epoch]
        for old in olds:
            self._sweep(w, self.node_id, old)
        log.info("cluster directory: %d blocks written to the store at epoch %d (%d older epochs swept)",
                 self._entries, epoch, len(olds))

    def _write(self, w, epoch: int, keys) -> None:
        """The store's entries of ``keys`` as ``own`` has them (a held block's tier bits, or its
        deletion), listed in this epoch's set, in pipelines of :data:`BATCH`."""
        node = self.node_id.encode()
        owned = self._owned(self.node_id, epoch)
        pipe = w.pipeline(transaction=False)
        pipe.sadd(self._epochs(self.node_id), str(epoch))
        added, gone, deleted, n = [], [], [], 0
        for key in keys:
            tag, bits, _ = self.own.get(key, (None, 0, 0))
            if tag is None:
                continue
            name = self.entry_name(tag, key)
            if bits:
                pipe.hset(name, node, b"%d:%d" % (epoch, bits))
                added.append(name)
            else:
                pipe.hdel(name, node)
                gone.append(name)
                deleted.append(key)
            n += 1
            if n % BATCH == 0:
                self._flush(pipe, owned, added, gone, deleted)
                pipe, added, gone, deleted = w.pipeline(transaction=False), [], [], []
        self._flush(pipe, owned, added, gone, deleted)

    def _flush(self, pipe, owned: bytes, added: list, gone: list, deleted: list) -> None:
        """Run one pipeline; only once it landed are the deleted blocks forgotten (a failed
        one leaves them to the rewrite, which deletes them again)."""
        if added:
            pipe.sadd(owned, *added)
        if gone:
            pipe.srem(owned, *gone)
        for r in pipe.execute(raise_on_error=False):
            if isinstance(r, Exception):
                raise r
        for key in deleted:
            cur = self.own.get(key)
            if cur is not None and not cur[1]:  # not stored again meanwhile
                del self.own[key]

    def _sweeps(self, w) -> None:
        """Registrations that ended (a peer left, or came back under a new epoch): one daemon
        (who takes the lock) deletes their entries."""
        while True:
            if self._event is None:
                try:
                    self._event = self._events.get_nowait()
                except queue.Empty:
                    return
            e = self._event
            if e.change in (Change.LEAVE, Change.EPOCH) and e.member.node_id != self.node_id:
                # Epochs up to the one that ended (LEAVE: the record as last seen; EPOCH: below
                # the new one), never a newer registration this node has not seen yet.
                upto = e.member.epoch if e.change is Change.LEAVE else e.member.epoch - 1
                for old in [int(x) for x in w.smembers(self._epochs(e.member.node_id))]:
                    live = self.membership.member(e.member.node_id)
                    if old > upto or (live is not None and live.epoch <= old):
                        continue
                    lock = self.prefix + b":l{" + e.member.node_id.encode() + b"}:" + str(old).encode()
                    if w.set(lock, self.node_id.encode(), nx=True, ex=SWEEP_LOCK_S):
                        self._sweep(w, e.member.node_id, old)
            self._event = None  # done: a failure above leaves it for the next step

    def _sweep(self, w, node_id: str, epoch: int) -> int:
        """Delete ``node_id``'s entries of ``epoch`` (and older) that its set lists; returns how many."""
        owned, node, gone, cursor = self._owned(node_id, epoch), node_id.encode(), 0, 0
        while True:
            cursor, names = w.sscan(owned, cursor, count=BATCH)
            if names:
                pipe = w.pipeline(transaction=False)
                for name in names:
                    pipe.execute_command("EVAL", DROP_OLD, 1, name, node, epoch)  # ClusterPipeline has no eval()
                gone += sum(int(r) for r in pipe.execute(raise_on_error=False) if not isinstance(r, Exception))
            if not cursor:
                break
        w.delete(owned)
        w.srem(self._epochs(node_id), str(epoch))
        log.info("cluster directory: swept %d entries of %s at epoch %d", gone, node_id, epoch)
        return gone

    # --- reads (any thread) -----------------------------------------------------------------
    def longest_prefix(self, namespace, chain: list[bytes], limit: int = DEFAULT_LIMIT, *,
                       head: Sequence[bytes] = ()) -> list[PrefixHit]:
        """The ``limit`` peers holding the longest prefixes of ``chain``, one
        :class:`PrefixHit` per tier step, as :meth:`kvstore.cluster.directory.Directory.longest_prefix`
        answers; ``head``: the request's keys before ``chain`` (a Lookup's local hits), which
        name the stretches' tags. One script call per stretch, stopping once no peer's run
        reaches the next. Only entries at the epoch membership has their node at; none when the
        store is down (for ``cluster.redis_retry_s`` after a failure)."""
        if not chain or limit < 1 or self.membership is None:
            return []
        if self.clock() < self._reader_down_until:
            return []
        live = {m.node_id: m.epoch for m in self.membership.peers()}
        start = len(head)
        runs: dict[str, list] = {}  # node -> [epoch, tier rank of each block of chain it holds in a row]
        stale: list[tuple[bytes, bytes, int]] = []
        client = self._reader
        if client is None:  # connected by the writer thread, never on a Lookup's path
            return []
        deadline = self.clock() + self.cfg.redis_timeout_s
        try:
            at = 0
            while at < len(chain) and (not at or self.clock() < deadline):  # past it: the runs so far
                pos = start + at  # the first block's place in the whole chain
                end = min(len(chain), at + STRETCH - pos % STRETCH)
                first = pos - pos % STRETCH
                stem = self.entry_name((head[first] if first < start else chain[first - start]), b"")
                part = chain[at:end]
                reply = client.execute_command("EVAL", READ, 1, stem + part[0], stem, b"".join(part))
                if not self._merge(reply, at, stem, part, live, runs, stale):
                    break
                at = end
        except Exception as e:  # noqa: BLE001 - redis.RedisError, socket errors: local hits only
            self._reader_failed(e)
            return []
        if stale:
            self._drop_stale(stale)
        hits: list[PrefixHit] = []
        for node, (epoch, *ranks) in runs.items():
            worst = 0
            for count, rank in enumerate(ranks):
                if rank > worst and count:
                    hits.append(PrefixHit(node, epoch, _SPEED[worst], count))
                worst = max(worst, rank)
            hits.append(PrefixHit(node, epoch, _SPEED[worst], len(ranks)))
        hits.sort(key=lambda h: (-h.n_blocks, _SPEED.index(h.tier), h.node_id))
        keep: set[str] = set()
        out = []
        for h in hits:
            if h.node_id not in keep and len(keep) >= limit:
                continue
            keep.add(h.node_id)
            out.append(h)
        return out

    def _merge(self, reply, at: int, stem: bytes, part: list[bytes], live: dict[str, int], runs: dict[str, list],
               stale: list) -> bool:
        """One stretch's answer into ``runs`` (``part``: blocks ``at ..`` of the chain, their
        names ``stem + key``): a peer's
        run goes on where its run so far reached ``at``, at the epoch membership has it at, up
        to its first entry at another epoch or that is not one of ours. Whether a run reached
        the stretch's end (the next stretch is worth reading)."""
        whole = False
        for i in range(0, len(reply) - 1, 2):
            try:  # an entry that is not one of ours (another writer's, damaged) ends the run
                node = reply[i].decode()
            except UnicodeDecodeError:
                continue
            have = live.get(node)
            if have is None or node == self.node_id:
                continue
            run = runs.get(node)
            if (0 if run is None else len(run) - 1) != at:
                continue  # it lacks an earlier block of the chain
            ranks = []
            for j, value in enumerate(reply[i + 1].split(b",")):
                epoch_b, _, bits_b = value.partition(b":")
                try:
                    epoch, bits = int(epoch_b), int(bits_b)
                except ValueError:
                    break
                if epoch != have:
                    if epoch < have:
                        stale.append((stem + part[j], reply[i], have - 1))
                    break
                if not bits & _TIER_BITS or bits & ~_TIER_BITS:
                    break
                ranks.append(_BEST[bits])
            if not ranks:
                continue
            if run is None:
                run = runs[node] = [have]
            run.extend(ranks)
            whole = whole or len(ranks) == len(part)
        return whole

    def _reader_client(self):
        """The Lookups' client (short deadlines): made on the writer thread (a connect tries
        each node in turn), which Lookups only use."""
        with self._reader_lock:
            if self._reader is None:
                self._reader = self._connect(self.cfg.redis_timeout_s)
            return self._reader

    def _reader_failed(self, e: Exception) -> None:
        self._failed("reader", e)
        with self._reader_lock:
            self._reader_down_until = self.clock() + self.cfg.redis_retry_s
            old, self._reader = self._reader, None
        close_client(old)

    def _drop_stale(self, stale: list[tuple[bytes, bytes, int]]) -> None:
        """Entries read at an older epoch than their node's: deleted off the Lookup's path, by
        one thread at a time (while one runs, others' finds are left to the sweep or a later read)."""
        if not self._dropping.acquire(blocking=False):
            return

        def run():
            try:
                w = self._writer_client()
                pipe = w.pipeline(transaction=False)
                for name, node, upto in stale:
                    pipe.execute_command("EVAL", DROP_OLD, 1, name, node, upto)
                pipe.execute(raise_on_error=False)
            except Exception:  # noqa: BLE001 - best effort: the sweep or the next reader deletes them
                pass
            finally:
                self._dropping.release()
        threading.Thread(target=run, name="cluster-directory-drop", daemon=True).start()

    def _failed(self, side: str, e: Exception) -> None:
        self.errors += 1
        if self.metrics is not None:
            self.metrics.directory_store_errors.labels(side=side).inc()
        log.warning("cluster directory: the store failed (%s: %s); %s", type(e).__name__, e,
                    "Lookups give local hits only for %.1f s" % self.cfg.redis_retry_s if side == "reader"
                    else "writes resume in %.1f s, rewriting this node's entries" % self.cfg.redis_retry_s)

    # --- what Stats reports -----------------------------------------------------------------
    def status(self) -> list[dict]:
        """No peer streams: peers write to the store."""
        return []

    def size(self) -> dict:
        """This node's own entries (the store holds the fleet's); any thread."""
        n = self._entries
        return {"entries": n, "blocks": n, "approx_bytes": len(self.own) * BYTES_PER_OWN_BLOCK, "backend": "redis"}

