"""The scheduler side of vLLM's KV connector on kvstore (one process; see
:mod:`kvstore.clients.vllm_connector`): which prompt tokens to load or pull from the daemon,
and each step's load, pull and save work for the workers (:class:`KVStoreConnectorMetadata`).

Not thread-safe: vLLM's scheduler calls it from one thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.clients.client import KVStoreError, pack
from kvstore.clients.leases import ReadLease
from kvstore.clients.vllm_setup import HIT_SOURCES, ConnectorSettings, KVStoreKVEvents, Link
from kvstore.tier_kind import TierKind
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.vllm")

# --- metadata: scheduler -> workers -----------------------------------------------------------

@dataclass(slots=True)
class BlockSpan:
    """kvstore blocks ``[start, end)`` of a request's token ids, and the request's vLLM block
    table (physical block ids of vLLM's ``block_size``-token blocks, from token 0)."""

    req_id: str
    token_ids: list[int]     # the prompt up to block ``end`` (keys are chained from token 0)
    start: int
    end: int
    block_table: list[int]
    holder: str = ""         # pulls: the peer (node id) the scheduler's Lookup named
    tables: tuple = ()       # every KV cache group's block table (hybrid models; [0] is block_table)
    wait_s: float = 0.0      # an announced transfer: wait this long for the span's blocks to arrive
    from_nvme: bool = False  # loads: the daemon is reading some of the blocks from NVMe (the Lookup's tiers)
    pinned: "Pin | None" = None  # loads: the blocks, pinned by the scheduler's Lookup (the worker copies, then releases)


@dataclass(frozen=True, slots=True)
class Pin:
    """A read lease the scheduler's Lookup took on a request's DRAM blocks from ``first`` on
    (LookupRequest.pin): the worker copies from ``offsets`` in place of an Acquire, then
    releases it naming ``session_id`` (the scheduler's session), if its arena is ``arena_id``."""

    session_id: bytes
    lease_id: int
    offsets: tuple
    arena_id: bytes
    first: int

    def lease(self, client) -> ReadLease | None:
        """The pinned blocks as a lease ``client`` copies from and releases, where ``client``
        maps the arena they are pinned in; else None, the pin released (the daemon restarted
        since the Lookup: the caller Acquires instead)."""
        if self.arena_id and self.arena_id == client.info.arena_id:
            resp = pb.AcquireResponse(lease_id=self.lease_id, offsets=self.offsets, acquired=len(self.offsets))
            return ReadLease(client, resp, session_id=self.session_id)
        self.release(client)
        return None

    def release(self, client) -> None:
        """Release it through ``client`` (any session's client of that daemon), not waited for."""
        client.release_later(pb.ReleaseRequest(session_id=self.session_id, lease_id=self.lease_id))


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockSpan] = field(default_factory=list)
    saves: list[BlockSpan] = field(default_factory=list)
    pulls: list[BlockSpan] = field(default_factory=list)  # asynchronous: pulled, then loaded
    snapshots: list = field(default_factory=list)  # hybrid models' state snapshots to save (vllm_state.Snapshot)


@dataclass(slots=True)
class _ReqState:
    prompt: list[int]
    tables: list[list[int]]  # per KV cache group (one for a model without hybrid KV)
    saved_blocks: int = 0  # prompt blocks already handed to a save (or loaded from kvstore)

    @property
    def block_table(self) -> list[int]:
        return self.tables[0]

    def span(self, req_id: str, start: int, end: int, bt: int) -> BlockSpan:
        """Blocks ``[start, end)`` of ``bt`` tokens (the tokens from 0: keys chain from there)."""
        return BlockSpan(req_id, self.prompt[:end * bt], start, end, list(self.tables[0]),
                         tables=tuple(list(t) for t in self.tables) if len(self.tables) > 1 else ())


@dataclass(slots=True)
class _Match:
    local: int     # tokens vLLM's own prefix cache holds
    external: int  # tokens to load from kvstore
    tiers: bytes   # tier of each hit block (kvstore.v1.Tier; TIER_REMOTE: to be pulled)
    holder: str = ""  # a pull: the peer holding the blocks after the local hits
    wait_s: float = 0.0  # an announced transfer (prefill -> this daemon): wait this long for it


# --- the scheduler side ---------------------------------------------------------------------

class ConnectorScheduler:
    """The scheduler's half of :class:`~kvstore.clients.vllm_connector.KVStoreConnector`: it
    looks prompts up in the daemon (TP rank 0's namespace, through ``link``) and tracks each
    request until it finishes. ``bt``: tokens per kvstore block; ``can_load``/``can_save``:
    the connector's KV role."""

    def __init__(self, settings: ConnectorSettings, link: Link, bt: int, can_load: bool, can_save: bool,
                 pin: bool = False) -> None:
        self.settings, self.link, self.bt = settings, link, bt
        self.can_load, self.can_save = can_load, can_save
        # One worker copies what this scheduler loads (vLLM's world size 1): its Lookup pins a
        # DRAM hit for that worker, saving it the Acquire's round trip (1-2 ms of a hit's step).
        self.pin = pin and can_load
        self._pins: dict[str, Pin] = {}  # looked up and pinned, not yet handed to a load
        self._matched: dict[str, _Match] = {}
        self._to_load: dict[str, int] = {}
        self._to_pull: dict[str, BlockSpan] = {}  # allocated, not yet in a step's metadata
        self._pulled: dict[str, int] = {}         # pulled, not yet scheduled: the span's end block
        self._reqs: dict[str, _ReqState] = {}
        self._stored: dict[str, int] = {}         # leading blocks the daemon held at the Lookup
        self._events: KVStoreKVEvents | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` to load from kvstore, leaving at least one
        prompt token to compute. Local hits: the leading blocks the policy says to load,
        loaded synchronously (inside the next forward): ``(tokens, False)``. When the daemon
        advises a pull (a peer holds the blocks after the local hits, and fetching them beats
        recomputing them): the local and the remote blocks, ``(tokens, True)``, vLLM's
        asynchronous load: the workers pull and load them while vLLM schedules other requests
        (:mod:`kvstore.clients.vllm_pull`). The Lookup costs no network unless ``ask_peers``."""
        self._matched.pop(request.request_id, None)
        self._stored.pop(request.request_id, None)
        self._unpin(request.request_id)  # looked up again (it waited for blocks): pinned anew below
        client = self.link.get() if self.can_load else None
        prompt = list(request.prompt_token_ids or [])
        cap = (len(prompt) - 1) // self.bt
        if client is None or cap <= 0 or num_computed_tokens % self.bt:
            return 0, False
        s = self.settings
        try:
            # Every full block is looked up, the last one too, though vLLM computes it (at least
            # one prompt token is computed): a block the daemon holds is not saved again (a
            # prompt of whole blocks had its last block copied, reserved and committed for
            # nothing at every hit: 1.5-2 ms of the step). promote_from/to: the NVMe blocks past
            # vLLM's own hit, up to the last one loaded, start their reads now, while vLLM
            # schedules the step and the worker comes to Acquire them.
            r = client.lookup_keys(client.keys(prompt[:len(prompt) // self.bt * self.bt]), ask_peers=s.ask_peers,
                                   promote_from=num_computed_tokens // self.bt, promote_to=cap, pin=self.pin)
        except KVStoreError as e:
            self.link.lost(e)
            # Nothing of it in flight here but the pins its Lookups handed to the worker, which
            # may be copying from them (vLLM's async scheduling): a daemon that only answered
            # late keeps the session for its TTL, and with it those pins, until the worker
            # releases them. Pins no load took yet are not handed out (the worker Acquires).
            self.link.retire(end_sessions=not self.pin)
            self._pins.clear()
            return 0, False
        if r.lease_id:
            self._pins[request.request_id] = Pin(client.session_id, r.lease_id, r.offsets, client.info.arena_id,
                                                 num_computed_tokens // self.bt)
        ext, pull = self._match(request, client, prompt, num_computed_tokens, cap, r)
        if pull or not ext:
            self._unpin(request.request_id)  # nothing loaded at once: no worker takes the pin
        return ext, pull

    def _match(self, request, client, prompt: list[int], num_computed_tokens: int, cap: int, r) -> tuple[int, bool]:
        """What :meth:`get_num_new_matched_tokens` answers for the Lookup ``r``."""
        s = self.settings
        if r.hit_blocks:
            self._stored[request.request_id] = r.hit_blocks
        r = replace(r, hit_blocks=min(r.hit_blocks, cap), load_blocks=min(r.load_blocks, cap),
                    remote_blocks=min(r.remote_blocks, max(0, cap - r.hit_blocks)))
        # A request back here after its pull (a whole miss leaves it nothing computed) is not
        # pulled again: a holder that just missed (stopped, cut off) would miss again until its
        # lease ends, and the request would wait out a deadline each time.
        again = request.request_id in self._pulled
        announced = 0 if again else min(self._announced(request, client, prompt), cap)
        if announced > r.hit_blocks:
            # A prefill server said it ships this prompt's blocks here: wait for them (vLLM's
            # asynchronous load) rather than race the transfer and recompute what is landing.
            ext = announced * self.bt - num_computed_tokens
            if ext > 0:
                tiers = bytes(r.tiers[:r.hit_blocks]) + bytes([TierKind.REMOTE]) * (announced - r.hit_blocks)
                self._matched[request.request_id] = _Match(num_computed_tokens, ext, tiers,
                                                           wait_s=s.transfer_wait_s)
                return ext, True
        wanted = r.advice == "pull" or not s.follow_policy
        remote = r.remote_blocks if s.pull and wanted and not again and r.remote_node_id else 0
        ext = (r.hit_blocks + remote) * self.bt - num_computed_tokens
        if remote and ext > 0:
            tiers = bytes(r.tiers[:r.hit_blocks]) + bytes([TierKind.REMOTE]) * remote
            self._matched[request.request_id] = _Match(num_computed_tokens, ext, tiers, r.remote_node_id)
            return ext, True
        blocks = min(r.load_blocks if s.follow_policy else r.hit_blocks, r.hit_blocks)
        ext = max(0, blocks * self.bt - num_computed_tokens)
        if ext:
            self._matched[request.request_id] = _Match(num_computed_tokens, ext, bytes(r.tiers[:blocks]))
        return ext, False

    def _announced(self, request, client, prompt: list[int]) -> int:
        """Blocks of ``prompt`` a prefill server announced it ships to this daemon (its
        ``request_finished`` params, passed on by the router), 0 when none; an announcement
        whose chain is not this engine's (another model, salt or TP layout) is ignored."""
        params = getattr(request, "kv_transfer_params", None) or {}
        n, last = params.get("kvstore_blocks"), params.get("kvstore_last_key")
        if not isinstance(n, int) or n <= 0 or not isinstance(last, str) or n * self.bt > len(prompt):
            return 0
        if client.keys(prompt[:n * self.bt])[-1].hex() != last:
            log.warning("kvstore: request %s announces %d blocks of another chain (model, tenant_salt or TP "
                        "layout differ from the prefill's); not waiting for them", request.request_id, n)
            return 0
        return n

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The loaded tokens by the tier that holds them (DRAM/HBM: host, NVMe: disk, a peer)."""
        m = self._matched.get(request.request_id)
        if not num_external_tokens:
            return {}
        if m is None or m.external != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        out: dict[CacheHitSource, int] = {}
        first = m.local // self.bt
        for tier in m.tiers[first:]:
            src = HIT_SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)  # IntEnum keys match ints
            out[src] = out.get(src, 0) + self.bt
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Remember a request whose external tokens got blocks; its load goes into the next
        ``build_connector_meta`` (the block ids come from the scheduler output there; a pull's
        from ``blocks``: its request is in no step's output until the pull has ended)."""
        if num_external_tokens <= 0:
            return
        m = self._matched.get(request.request_id)
        if m is not None and (m.holder or m.wait_s):
            end = (m.local + num_external_tokens) // self.bt
            tables = blocks.get_block_ids()
            self._to_pull[request.request_id] = BlockSpan(
                request.request_id, list(request.prompt_token_ids or [])[:end * self.bt], m.local // self.bt, end,
                list(tables[0]), m.holder, tuple(list(t) for t in tables) if len(tables) > 1 else (), m.wait_s)
        else:
            self._to_load[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        """This step's loads (new and resumed requests with external tokens), pulls (requests
        waiting for remote KV since this step) and saves (prompt blocks that are full once this
        step's tokens are computed). Clears the pending loads and pulls."""
        meta = KVStoreConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids or []), [list(t) for t in new.block_ids])
            pulled = self._pulled.pop(new.req_id, None)
            if pulled is not None:  # what the pull loaded is in kvstore; what vLLM recomputes is not
                st.saved_blocks = min(pulled, new.num_computed_tokens // self.bt)
            st.saved_blocks = max(st.saved_blocks, self._stored.pop(new.req_id, 0))  # held: not saved again
            self._add_load(meta, new.req_id, st, new.num_computed_tokens)
            self._add_save(meta, new.req_id, st, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if new_ids is not None:
                # A request resumed after preemption gets its whole block table anew.
                st.tables = ([list(t) for t in new_ids] if resumed else
                             [have + list(t) for have, t in zip(st.tables, new_ids)])
            if resumed:  # its KV was dropped at preemption; reload the external part
                self._pulled.pop(req_id, None)  # (or a pull did, and saved_blocks already covers it)
                self._add_load(meta, req_id, st, cached.num_computed_tokens[i])
            self._add_save(meta, req_id, st, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        for req_id, span in self._to_pull.items():
            self._matched.pop(req_id, None)
            meta.pulls.append(span)
            self._pulled[req_id] = span.end
        self._to_load.clear()
        self._to_pull.clear()
        return meta

    def _add_load(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState, computed: int) -> None:
        ext = self._to_load.pop(req_id, 0)
        m = self._matched.pop(req_id, None)
        pin = self._pins.pop(req_id, None)
        if not ext:
            self._release(pin)
            return
        local = m.local if m is not None and m.external == ext else computed - ext
        start, end = local // self.bt, (local + ext) // self.bt
        span = st.span(req_id, start, end, self.bt)
        span.from_nvme = m is not None and TierKind.NVME in m.tiers[start:end]
        if pin is not None and pin.first == start and len(pin.offsets) >= end - start:
            span.pinned = replace(pin, offsets=pin.offsets[:end - start])  # the worker releases it
        else:
            self._release(pin)
        meta.loads.append(span)
        st.saved_blocks = max(st.saved_blocks, end)

    def _unpin(self, req_id: str) -> None:
        self._release(self._pins.pop(req_id, None))

    def _release(self, pin: Pin | None) -> None:
        client = self.link.get() if pin is not None else None
        if client is not None:
            try:
                pin.release(client)
            except Exception as e:  # noqa: BLE001 - the lease TTL reclaims the pins
                log.debug("kvstore: releasing an unused pin failed: %s", e)

    def _add_save(self, meta: KVStoreConnectorMetadata, req_id: str, st: _ReqState, done_tokens: int) -> None:
        if not self.can_save:
            return
        full = min(done_tokens, len(st.prompt)) // self.bt
        if full > st.saved_blocks:
            meta.saves.append(st.span(req_id, st.saved_blocks, full, self.bt))
            st.saved_blocks = full

    def update_connector_output(self, connector_output) -> None:
        """Collect the workers' KV cache events for ``take_events``."""
        ev = connector_output.kv_cache_events
        if not isinstance(ev, KVStoreKVEvents):
            return
        if self._events is None:
            self._events = ev
        else:
            self._events.add_events(ev.get_all_events())
            self._events.increment_workers(ev.get_number_of_workers())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Blocks stored into kvstore (``BlockStored``, medium ``CPU``) and blocks a load found
        gone (``BlockRemoved``) since the last call, named by their kvstore keys."""
        if self._events is None:
            return
        events, self._events = self._events, None
        yield from events.aggregate().get_all_events()

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Its saves were committed inside their steps, so vLLM may free
        its blocks now (False). With ``transfer_peer`` set, the daemon is asked (without
        waiting) to ship the prompt's committed blocks to that peer; the returned params say so."""
        st = self._reqs.pop(request.request_id, None)
        for pending in (self._matched, self._to_load, self._to_pull, self._pulled, self._stored):
            pending.pop(request.request_id, None)
        self._unpin(request.request_id)  # finished (or aborted) before its load was scheduled
        peer = self.settings.transfer_peer
        client = self.link.get() if peer and st is not None and st.saved_blocks else None
        if client is None:
            return False, None
        keys = client.keys(st.prompt[:st.saved_blocks * self.bt])
        req = pb.TransferRequest(session_id=client.session_id, keys=pack(keys), peer=peer,
                                 deadline_s=self.settings.save_timeout_s, pipelined=False)
        fut = client.stub.Transfer.future(req, timeout=self.settings.save_timeout_s)
        fut.add_done_callback(lambda f: f.exception() and log.warning("transfer to %s failed: %s", peer, f.exception()))
        # The announcement a router passes to the decode server: it waits for these blocks.
        return False, {"kvstore_transfer_peer": peer, "kvstore_blocks": st.saved_blocks,
                       "kvstore_last_key": keys[-1].hex()}
