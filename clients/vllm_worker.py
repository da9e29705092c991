"""The worker side of vLLM's KV connector on kvstore (each TP rank; see
:mod:`kvstore.clients.vllm_connector`): copies between vLLM's paged KV cache and the daemon's
arena, layer by layer, for the loads, pulls and saves the scheduler put in the step's
:class:`~kvstore.clients.vllm_scheduler.KVStoreConnectorMetadata`.

Failures never serve wrong KV and never stop vLLM: a block that cannot be loaded is a load
error (vLLM recomputes it), a save that fails is aborted (a later miss).

Not thread-safe: vLLM calls it from one thread (a pull's calls to the daemon run on the
fetcher's threads, which touch none of this state).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace

import grpc
import torch
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.clients.client import KVStoreError
from kvstore.clients.gpu import GpuKVPath, LoadHandle, StoreHandle
from kvstore.clients.leases import RESERVED, PinnedPieces, QuietReleases, ReadLease
from kvstore.clients.vllm_pages import CPU_BACKEND, check_cpu_pages, layer_pages
from kvstore.clients.vllm_pull import PullFetcher
from kvstore.clients.vllm_scheduler import BlockSpan, KVStoreConnectorMetadata
from kvstore.clients.vllm_setup import LOST, ConnectorSettings, KVStoreConnectorStats, KVStoreKVEvents, Link
from kvstore.keys import chain_keys
from kvstore.clients.hbm_paged import wait_events
from kvstore.layout import KVLayout

log = logging.getLogger("kvstore.vllm")
class ConnectorWorker:
    """One TP rank's half of :class:`~kvstore.clients.vllm_connector.KVStoreConnector`, over
    this rank's session (``link``). ``bt``: tokens per kvstore block, ``block_size``: vLLM's;
    ``event_root``: the namespace root whose keys name blocks in KV events (TP rank 0's, the
    one the scheduler looks up); ``writes``: False on a rank whose KV another rank stores (MLA:
    the latent is the same on every rank, rank 0 writes it)."""

    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings, link: Link, layout: KVLayout,
                 bt: int, block_size: int, event_root: bytes, writes: bool = True) -> None:
        self.vllm_config, self.kv_cache_config = vllm_config, kv_cache_config
        self.settings, self.link, self.layout = settings, link, layout
        self.bt, self.block_size, self.event_root = bt, block_size, event_root
        self.writes = writes
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._pages: list = []
        self._path: GpuKVPath | None = None
        self._path_generation = 0
        self._loads: list[tuple[BlockSpan, LoadHandle]] = []
        self._saves: list[tuple[BlockSpan, StoreHandle]] | None = None  # None: not reserved this step
        # This step's Reserves, sent on their own thread while its loads pin and copy (each is
        # a daemon round trip of 1-3 ms on a busy host); their answers are taken in _begin_saves.
        self._reserver = ThreadPoolExecutor(1, thread_name_prefix="kvstore-reserve")
        # The loads' Releases, sent on the Reserves' thread once the engine is quiet.
        self._releases = QuietReleases(self._send_releases, self._quiet_s)
        self._acquirer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-acquire")  # NVMe loads' pieces
        self._reserving: tuple[KVStoreConnectorMetadata, GpuKVPath, Future] | None = None
        self._failed_reqs: set[str] = set()
        self._load_errors: set[int] = set()
        # vLLM blocks whose load failed in this step or the one before: with async scheduling
        # the next step is built before vLLM hears of the failure, and another request may have
        # hit those blocks in vLLM's own prefix cache. No save covering one of them is committed.
        self._bad_blocks: set[int] = set()
        self._bad_blocks_before: set[int] = set()
        self._stats = KVStoreConnectorStats()
        self._worker_events: list[KVCacheEvent] = []
        # pulls: fetching on the fetcher's threads, then copying, then reported
        self._fetcher = PullFetcher(settings.pull_timeout_s, settings.load_wait_s, settings.rpc_timeout_s)
        self._pulling: dict[str, BlockSpan] = {}
        self._pull_loads: list[tuple[BlockSpan, LoadHandle, float]] = []  # and the copies' deadline
        self._recved: set[str] = set()  # pulls ended (loaded or not) since the last get_finished
        # A hybrid model's group (vllm_hybrid.HybridWorker sets a set here): the requests a save
        # of this step failed for; and the requests whose stored blocks this step must not
        # announce (another group failed them: the parts are one block).
        self.saves_failed: set[str] | None = None
        self.unannounced: set[str] = set()
        self._events_due = False  # report events this step even if none (a rank writing parts)
        self._active_at = time.monotonic()  # the last step's start, layer or end (quiet: see QuietReleases)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer cache views, in layer order; mapped to canonical pages here so an
        unsupported backend fails at start-up with a clear error, not at the first save."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        names = list(kv_caches)
        if len(names) != self.layout.num_layers:
            raise ValueError(f"kvstore: vLLM registered {len(names)} KV cache layers; the model's layout has "
                             f"{self.layout.num_layers} (hybrid models with several cache groups are not supported)")
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, names)
        num_blocks = int(self.kv_cache_config.num_blocks)
        pages, checked = [], set()
        for name in names:
            layer = layers.get(name)
            backend = layer.get_attn_backend().get_name() if layer is not None else "unknown"
            isa = "vec"
            if backend == CPU_BACKEND:  # the layout its kernels write (probed once per ISA, below)
                isa = getattr(layer, "isa", None) or _cpu_isa(self.vllm_config, self.layout, kv_caches[name])
            pages.append(layer_pages(name, kv_caches[name], self.layout, backend, num_blocks, cpu_isa=isa))
            if backend == CPU_BACKEND and isa not in checked:
                check_cpu_pages(kv_caches[name], isa, self.vllm_config.model_config.dtype,
                                str(self.vllm_config.cache_config.cache_dtype or "auto"))
                checked.add(isa)
        self._kv_caches, self._pages = dict(kv_caches), pages
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._ensure_path()

    def _ensure_path(self) -> GpuKVPath | None:
        """The copy path over the current session's arena (re-made after a reconnect)."""
        client = self.link.get()
        if client is None or not self._pages:
            return None
        if self._path is None or self._path_generation != self.link.generation or self._path.arena is not client.arena:
            if self._path is not None:
                # A client that re-registered with a restarted daemon closed the old arena; the
                # path's views kept it mapped. Unmapped off vLLM's thread, at the lowest priority
                # (the munmap frees the dead daemon's pages, ~0.3 s of CPU per GiB here).
                self._drop_path().unmap_in_background(self._quiet_s)
            # vLLM's CPU backend: the copies are waited for before the forward (_issue_load),
            # so they run in vLLM's thread; a copy thread only competes with its OpenMP team.
            cpu = self._pages[0].halves[0].device.type == "cpu"
            self._path = GpuKVPath(client, self._pages, copy_path=self.settings.copy_path, inline=cpu)
            self._path_generation = self.link.generation
        return self._path

    def _send_releases(self, items: list) -> None:
        # On the Reserves' thread: starting even a gRPC future costs vLLM's thread 0.5-1.2 ms
        # here (measured in the step), a hand-off to a thread ~0.05 ms.
        for req_id, h in items:
            self._reserver.submit(_release, req_id, h)

    def _quiet_s(self) -> float:
        """Seconds since this worker's last step began, saved a layer (every forward does) or ended."""
        return time.monotonic() - self._active_at

    def _drop_path(self):
        """Close the copy path; returns the arena it copied to and from."""
        arena = self._path.arena
        self._path.close()
        self._path = None  # its views of the arena go with it
        return arena

    def _rows(self, path: GpuKVPath, span: BlockSpan) -> torch.Tensor:
        bt = self.bt
        return path.paged.token_rows(span.block_table, span.end * bt, span.start * bt)

    def _vllm_blocks(self, span: BlockSpan, first_block: int) -> set[int]:
        """vLLM block ids holding kvstore blocks ``[first_block, span.end)`` of ``span``."""
        lo, hi = first_block * self.bt, span.end * self.bt
        return set(span.block_table[lo // self.block_size: -(-hi // self.block_size)])

    def _event_keys(self, span: BlockSpan) -> list[bytes]:
        return chain_keys(self.event_root, span.token_ids, self.bt)[span.start:span.end]

    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        """Pin this step's load blocks and issue their copies, layer 0 first. Blocks that
        cannot be pinned are load errors (vLLM recomputes them). Then the pulls: this step's
        start on the fetcher's threads; those fetched since the last step have their copies
        issued, behind this step's loads on the copy stream (the forward waits for those only;
        on steps without synchronous loads vLLM calls this after the forward)."""
        self._active_at = time.monotonic()
        path = self._ensure_path() if meta.loads else None
        if path is not None and meta.saves and self.writes and self._saves is None:
            self._reserving = (meta, path, self._reserver.submit(_reserve_all, path.client, meta.saves))
        for span in meta.loads:
            issued: list[LoadHandle] = []
            try:
                if path is None:
                    raise KVStoreError(grpc.StatusCode.UNAVAILABLE, "kvstore daemon not reachable")
                self._start_load(path, span, issued)
            except Exception as e:  # noqa: BLE001 - whatever failed, vLLM recomputes; never fail its step
                log.warning("kvstore load of %s failed; vLLM recomputes it: %s", span.req_id, e)
                if isinstance(e, KVStoreError):
                    self.link.lost(e)
            self._loads += [(span, h) for h in issued]
            got = sum(h.blocks for h in issued)
            if got < span.end - span.start:
                # Evicted since the Lookup (or the daemon failed): vLLM recomputes these blocks.
                self._fail_load(span, span.start + got, removed=True)
        if meta.pulls or self._pulling:
            self._advance_pulls(meta.pulls)

    def _start_load(self, path: GpuKVPath, span: BlockSpan, issued: list[LoadHandle]) -> None:
        """Pin the span's blocks (as many leading ones as are still there) and issue every
        layer's copy: a :class:`LoadHandle` per lease, appended to ``issued`` as it is issued.

        A span the scheduler's Lookup pinned (``span.pinned``: a DRAM hit, one worker) is
        copied at once, without an Acquire. A span the daemon reads from NVMe is pinned in
        pieces of at least ``load_piece_bytes``, one Acquire after the other on the acquire
        thread, each pinning every leading block landed by then, and each piece is copied as its
        Acquire returns: the daemon lands its reads piece by piece (``nvme.promote_piece_bytes``),
        so the copy of one piece overlaps the reads of the next instead of following them all,
        and pieces that landed together are one copy."""
        client = path.client
        lease = span.pinned.lease(client) if span.pinned is not None else None
        if lease is not None:  # one piece, pinned already
            leases = nullcontext([(span.end - span.start, lease)])
        else:
            keys = client.keys(span.token_ids)[span.start:span.end]
            piece = self.settings.load_piece_bytes
            per = max(1, piece // self.layout.block_bytes) if span.from_nvme and piece else len(keys)
            leases = PinnedPieces(client, keys, per, self.settings.load_wait_s, self._acquirer)
        start = span.start
        with leases as pieces:
            for want, lease in pieces:
                if client.arena is not path.arena:
                    # The client registered again with a restarted daemon (a new arena) since
                    # the path was made, in an Acquire or before: the lease's offsets are the
                    # new arena's, so copy through a path over it. Without this the first loads
                    # after a daemon restart failed and vLLM recomputed them (measured:
                    # 0.39-0.49 s each for 2 s, the link's retry interval, instead of a ~50 ms load).
                    path = self._ensure_path() or path
                h = self._load_pinned(path, replace(span, start=start, end=start + want), lease)
                if h is None:
                    return
                issued.append(h)
                start += h.blocks
                if h.blocks < want:  # evicted since the Lookup: the blocks after it are recomputed
                    return

    def _load_pinned(self, path: GpuKVPath, span: BlockSpan, lease: ReadLease) -> LoadHandle | None:
        """Issue every layer's copy of the span's leading blocks that ``lease`` pins; None
        (the lease ended) when it pins none."""
        path.check_arena([lease])  # the client re-registered with a restarted daemon: offsets are not ours
        if lease.count == 0:
            lease.release()
            return None
        part = BlockSpan(span.req_id, span.token_ids, span.start, span.start + lease.count, span.block_table)
        try:
            h = LoadHandle(path, [lease], list(lease.offsets[:lease.count]),
                           path.mover.device_rows(self._rows(path, part)))
        except BaseException:
            lease.release()
            raise
        try:
            self._issue_load(path, h)
        except BaseException:
            _quietly(h.release)
            raise
        return h

    def _issue_load(self, path: GpuKVPath, h: LoadHandle) -> None:
        if path.emulated:
            # CPU caches: a copy thread per layer only competes with the forward for the cores
            # (and the GIL); one bulk copy before the forward costs less than it could hide.
            # Waited for here: vLLM's CPU MLA layers call their attention directly, without
            # ``wait_for_layer_load`` (its hook is on the custom-op path only).
            if not wait_events(h.load_all(), self.settings.load_wait_s):
                raise TimeoutError(f"load copies not done within {self.settings.load_wait_s} s")
        else:
            for l in range(h.path.layout.num_layers):  # layer l+1 crosses the bus while layer l computes
                h.load_layer(l)

    def _fail_load(self, span: BlockSpan, first_block: int, removed: bool = False) -> None:
        bad = self._vllm_blocks(span, first_block)
        self._load_errors |= bad
        self._bad_blocks |= bad
        self._failed_reqs.add(span.req_id)
        self._stats.data["load_failed_blocks"] += span.end - first_block
        if removed:
            self._worker_events.append(BlockRemoved(block_hashes=self._event_keys(span)[first_block - span.start:],
                                                    medium=MEDIUM_CPU))

    # --- pulls (vLLM's asynchronous load) ----------------------------------------------------
    def _advance_pulls(self, new: list[BlockSpan]) -> None:
        """Start ``new``'s pulls; issue the copies of the pulls fetched since the last step.
        Nothing here waits for a daemon or a peer."""
        path = self._ensure_path()
        for span in new:
            self._pulling[span.req_id] = span
            if path is None:
                self._end_pull(span, span.start, "kvstore daemon not reachable")
                continue
            self._fetcher.submit(span.req_id, path.client, path.client.keys(span.token_ids), span.start, span.holder,
                                 span.wait_s)
        for f in self._fetcher.done():
            span = self._pulling[f.req_id]
            self._stats.data["pulled_blocks"] += f.pulled
            h, why = None, f.detail
            if f.lease is not None and (path is None or f.client is not path.client):
                _quietly(f.lease.release)  # the session was lost meanwhile: its offsets are not this path's
                why = "the session with the daemon ended during the pull"
            elif f.lease is not None:
                try:
                    h = self._load_pinned(path, span, f.lease)
                except Exception as e:  # noqa: BLE001 - whatever failed, vLLM recomputes; never fail its step
                    why = f"{why}; {e}" if why else str(e)
                    if isinstance(e, KVStoreError):
                        self.link.lost(e)
            if h is None:
                self._end_pull(span, span.start, why)
                continue
            if h.blocks < span.end - span.start:
                self._end_pull(span, span.start + h.blocks, why, done=False)
            self._pull_loads.append((span, h, time.monotonic() + self.settings.load_wait_s))

    def _end_pull(self, span: BlockSpan, first_block: int, why: str, done: bool = True) -> None:
        """Blocks ``[first_block, span.end)`` of a pulled span did not load: load errors, so
        vLLM recomputes them (reported in the pass the request is, or before). ``done``: the
        request's pull is over (reported finished at the next ``get_finished``)."""
        if first_block < span.end:
            log.warning("kvstore pull of %s: blocks %d-%d not loaded, vLLM recomputes them: %s", span.req_id,
                        first_block, span.end - 1, why or "not here")
            self._load_errors |= self._vllm_blocks(span, first_block)
            self._stats.data["pull_failed_blocks"] += span.end - first_block
        if done:
            self._recved.add(span.req_id)
            self._pulling.pop(span.req_id, None)

    def _land_pulls(self) -> None:
        """Pulled spans whose copies have landed (or failed, or passed ``load_wait_s``) end."""
        now, left = time.monotonic(), []
        for span, h, deadline in self._pull_loads:
            try:
                landed, why = h.wait(0), f"copies not done within {self.settings.load_wait_s} s"
            except Exception as e:  # noqa: BLE001 - a failed copy is a load error
                landed, why = None, f"copy failed: {e}"
            if landed is False and now < deadline:
                left.append((span, h, deadline))
                continue
            _quietly(h.release)
            if landed:
                self._stats.data["loaded_blocks"] += h.blocks
                self._end_pull(span, span.end, "")
            else:
                self._end_pull(span, span.start, why)
        self._pull_loads = left

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait (at most ``load_wait_s``) for this layer's load copies; on a GPU, order the
        compute stream after them. A copy that failed or timed out turns its request's blocks
        into load errors: vLLM discards the step's output for it and recomputes. A request
        whose load already failed part-way is waited for too: vLLM keeps the blocks before the
        failed one as computed, and its next step reads them."""
        l = self._layer_index.get(layer_name)
        if l is None or not self._loads:
            return
        t0 = time.perf_counter()
        for span, h in list(self._loads):
            try:
                h.wait_layer(l, timeout_s=self.settings.load_wait_s)
            except Exception as e:  # noqa: BLE001 - a failed copy is a load error, not a failed step
                if span.req_id not in self._failed_reqs:
                    log.warning("kvstore load of %s failed at layer %d; vLLM recomputes it: %s", span.req_id, l, e)
                    self._fail_load(span, span.start)
                else:  # failed from a later block already: its leading blocks now too (counted once)
                    bad = self._vllm_blocks(span, span.start)
                    self._load_errors |= bad
                    self._bad_blocks |= bad
        self._stats.data["load_s"] += time.perf_counter() - t0

    def _begin_saves(self, meta: KVStoreConnectorMetadata | None) -> list[tuple[BlockSpan, StoreHandle]]:
        """Reserve slots for this step's saves, once per step, whichever hook comes first."""
        if self._saves is not None:
            return self._saves
        self._saves = []
        sent, self._reserving = self._reserving, None
        if sent is not None and sent[0] is meta:
            path, answers = sent[1], sent[2].result()
        else:
            if sent is not None:  # sent for a step whose saves never began: give the slots back
                _abort_all(sent[2].result())
            path = self._ensure_path() if meta is not None and meta.saves and self.writes else None
            answers = _reserve_all(path.client, meta.saves) if path is not None else []
        for i, (span, (w, e)) in enumerate(zip(meta.saves if path is not None else (), answers)):
            moved = False
            if e is None:
                try:
                    path.check_arena(w)  # ends the leases when the client re-registered meanwhile
                except KVStoreError as err:
                    # Without its traceback: kept in a local of this frame, it would hold the
                    # frame (and the old path, and the lost daemon's arena) in a cycle.
                    e, moved = err.with_traceback(None), True
            if e is not None:  # a save is best effort: the blocks stay uncached
                log.warning("kvstore save of %s skipped: %s", span.req_id, e)
                self._save_failed(span)
                if isinstance(e, KVStoreError) and not moved:
                    self.link.lost(e)
                if moved or self.link.client is None:  # the rest are not this path's to fill
                    _abort_all(answers[i + 1:])
                    break
                continue
            offsets = [o if st == RESERVED else None for lease in w for st, o in zip(lease.states, lease.offsets)]
            self._saves.append((span, StoreHandle(path, w, offsets, path.mover.device_rows(self._rows(path, span)))))
        return self._saves

    def save_kv_layer(self, layer_name: str, meta: KVStoreConnectorMetadata | None) -> None:
        """Issue the copy of this layer of this step's save blocks into their reserved slots,
        after the KV the compute stream wrote so far."""
        self._active_at = time.monotonic()  # each layer of a forward: the engine is not quiet
        l = self._layer_index.get(layer_name)
        if l is None:
            return
        for span, h in self._begin_saves(meta):
            if span.req_id not in self._failed_reqs:
                h.store_layer(l)

    def wait_for_save(self, meta: KVStoreConnectorMetadata | None) -> None:
        """Copy the layers no ``save_kv_layer`` copied, wait and commit; release the loads."""
        t0 = time.perf_counter()
        saves = self._begin_saves(meta) if meta is not None else (self._saves or [])
        loads, self._loads, self._saves = self._loads, [], None
        failed, self._failed_reqs = self._failed_reqs, set()
        stored: list[KVCacheEvent] = []
        try:
            bad = self._bad_blocks | self._bad_blocks_before
            for span, h in saves:
                if span.req_id in failed or bad & self._vllm_blocks(span, 0):
                    _quietly(h.abort)  # computed from (or over) a prefix that failed to load
                    self._save_failed(span)
                    continue
                try:
                    h.store_all()
                    n = h.commit(self.settings.save_timeout_s)
                except Exception as e:  # noqa: BLE001 - a save is best effort; never fail vLLM's step
                    log.warning("kvstore save of %s failed (blocks not stored): %s", span.req_id, e)
                    _quietly(h.abort)
                    self._save_failed(span)
                    if isinstance(e, KVStoreError):
                        self.link.lost(e)
                    continue
                self._stats.data["saved_blocks"] += n
                if span.req_id not in self.unannounced:
                    stored.append(self._stored_event(span))
        finally:
            for span, h in loads:
                if span.req_id not in failed:
                    self._stats.data["loaded_blocks"] += h.blocks
            self._releases.hold([(span.req_id, h) for span, h in loads])
            self._bad_blocks_before, self._bad_blocks = self._bad_blocks, set()
            if self.link.retiring():
                self._releases.flush()  # before the lost client is closed
            self._reserver.submit(self.link.retire)  # after the releases sent, in order
            client = self.link.client
            if self._path is not None and (client is None or client.arena is not self._path.arena):
                # The daemon was lost in this step, or the client re-registered with a restarted
                # one (a new arena): the old arena is unmapped now, between steps, once the lost
                # client is closed, rather than beside the first load that meets the new daemon
                # (measured there: 170 ms of a 0.36 s first NVMe hit after a restart; after a
                # re-registration, 60-90 ms of that load's copy).
                self._reserver.submit(self._drop_path().unmap_in_background, self._quiet_s)
        self._worker_events += stored
        self._active_at = time.monotonic()
        if saves:
            self._stats.data["save_s"] += time.perf_counter() - t0
            # A block written in parts is whole only if every rank's part is in: vLLM keeps the
            # events every reporting worker sent, so a rank with saves reports even none.
            self._events_due = getattr(self.link, "shard", None) is not None

    def _save_failed(self, span: BlockSpan) -> None:
        self._stats.data["save_failed_blocks"] += span.end - span.start
        if self.saves_failed is not None:
            self.saves_failed.add(span.req_id)

    def _stored_event(self, span: BlockSpan) -> BlockStored:
        chain = chain_keys(self.event_root, span.token_ids, self.bt)  # once: the parent is in it
        keys = chain[span.start:span.end]
        return BlockStored(block_hashes=keys, parent_block_hash=chain[span.start - 1] if span.start else None,
            token_ids=span.token_ids[span.start * self.bt:span.end * self.bt], block_size=self.bt,
            lora_id=None, medium=MEDIUM_CPU, lora_name=None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose pull ended since the last call (vLLM schedules them now): loaded,
        or with the blocks that did not load among this pass's load errors. Synchronous loads
        and saves finish inside their step."""
        if self._pull_loads:
            self._land_pulls()
        done, self._recved = self._recved, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        due, self._events_due = self._events_due, False
        if not self._worker_events and not due:
            return None
        ev = KVStoreKVEvents(num_workers=1)
        ev.add_events(self._worker_events)
        self._worker_events = []
        return ev

    def shutdown(self) -> None:
        self._fetcher.close()
        sent, self._reserving = self._reserving, None
        if sent is not None:
            _abort_all(sent[2].result())
        self._acquirer.shutdown(wait=False, cancel_futures=True)
        self._releases.close()
        self._reserver.shutdown(wait=True)  # the releases it still holds go out first
        for _, h in self._saves or ():
            _quietly(h.abort)
        for _, h in [*self._loads, *((span, h) for span, h, _ in self._pull_loads)]:
            _quietly(h.release)
        self._saves, self._loads, self._pull_loads = None, [], []
        if self._path is not None:
            _quietly(self._path.close)
            self._path = None


def _reserve_all(client, spans: list[BlockSpan]) -> list[tuple]:
    """Reserve each span's blocks: ``([WriteLease, ...], None)`` or ``(None, error)`` per span, in
    order, stopping after an error that loses the session (the rest are not sent)."""
    out = []
    for span in spans:
        keys = client.keys(span.token_ids)
        try:
            out.append((client.reserve_all(keys[:span.end], start=span.start, token_ids=span.token_ids), None))
        except Exception as e:  # noqa: BLE001 - handed to the caller, which logs and counts it
            out.append((None, e))
            if getattr(getattr(e, "code", None), "name", "") in LOST:  # Link.lost drops the session
                break
    return out


def _release(req_id: str, h: LoadHandle) -> None:
    try:
        h.release(wait=True)
    except Exception as e:  # noqa: BLE001 - the lease TTL reclaims the pins
        log.warning("kvstore release after the load of %s failed: %s", req_id, e)


def _abort_all(answers) -> None:
    for leases, _ in answers:
        for w in leases or ():
            _quietly(w.abort)


def _quietly(fn) -> None:
    """Run a clean-up step whose failure must not stop the next (the lease TTL is the backstop)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        log.warning("kvstore clean-up failed: %s", e)


def _cpu_isa(vllm_config, layout: KVLayout, view: torch.Tensor) -> str:
    """The ISA vLLM's CPU backend picks for this cache (the layer did not say)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(vllm_config.model_config.dtype, int(view.shape[2]), layout.head_dim,
                         str(vllm_config.cache_config.cache_dtype or "auto"))
