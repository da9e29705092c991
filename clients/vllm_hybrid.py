"""Hybrid models in vLLM's KV connector on kvstore: vLLM's hybrid KV cache manager (HMA) kept
on, one kvstore namespace per KV cache group (see :mod:`kvstore.clients.vllm_connector`).

With HMA, vLLM splits a model's layers into KV cache groups of one spec each (Gemma-3: five
sliding-window groups and one full-attention group, each with its own block table) and gives a
sliding-window layer blocks only for the tokens its window still sees (the rest of its table is
vLLM's null block). The connector follows that split:

- **Namespaces.** Each group stores its layers' KV under a namespace of its own (the model id
  with ``#kv-group:<kind>:<index>``, the group's layer count in the layout), keyed by the same
  token chain. A block of the prompt is the set of its groups' blocks.
- **Hits, all or nothing.** The scheduler looks the prompt up in every group's namespace and
  counts a prefix only up to where every group can restore it (the least of the groups' leading
  hits): a writer killed between groups, or one group's block evicted, is a miss there, never
  a partial load.
- **Loads are asynchronous** (vLLM's ``load_kv_async``): vLLM 0.32 takes load failures of a
  several-group model only by request (``failed_recving``; block ids are per group), and those
  only for requests waiting for remote KV. Each group's worker pins and copies its blocks off
  the forward path (:class:`~kvstore.clients.vllm_pull.PullFetcher` with no peer); the request
  is reported once every group landed; a request any group failed is reported failed and vLLM
  recomputes it from the start (the connector's ``recompute`` policy).
- **Windows.** A sliding-window group loads only the blocks vLLM gave it (those its window
  needs); blocks behind the window stay vLLM's null block. Saves store every block the group
  still holds when it is computed, so a later prompt can stop anywhere.
- **State groups** (Mamba / linear attention: Qwen3-Next, Jamba, ...): the state snapshots
  vLLM's prefix caching keeps at block boundaries, stored and restored exactly
  (:mod:`kvstore.clients.vllm_state`); a prefix counts only up to a boundary every state group
  has a snapshot for.
- **Refused, never guessed.** A group kvstore cannot restore exactly (Mamba state outside
  vLLM's ``align`` mode or with speculative-decoding blocks, chunked-local, encoder or cross
  attention, groups of different block sizes) turns prefix reuse off for the model, with a
  start-up warning naming the group; the engine then runs exactly as plain vLLM (HMA on, no
  lookups, no saves). ``transfer_peer`` (prefill/decode shipping) is refused at start-up for
  several-group models.

Events (``BlockStored``/``BlockRemoved``) come from the first full-attention group, whose keys
the namespaces share; a step's stored blocks of a request whose save failed in another group
are not announced (the parts are one block).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from kvstore.clients.client import KVStoreError
from kvstore.clients.vllm_scheduler import BlockSpan, ConnectorScheduler, KVStoreConnectorMetadata, _Match
from kvstore.clients.vllm_setup import ConnectorSettings, KVStoreConnectorStats, KVStoreKVEvents, Link
from kvstore.clients.vllm_state import Snapshot, StateWorker, state_layout, state_shard, state_signature
from kvstore.clients.vllm_worker import ConnectorWorker
from kvstore.keys import Namespace
from kvstore.layout import HeadShard, KVLayout

log = logging.getLogger("kvstore.vllm")

NULL_BLOCK = 0  # vLLM's null block (BlockPool's first block): a table entry nobody reads or writes
FULL, SLIDING, STATE = "full", "sliding", "state"


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups as kvstore stores it."""

    index: int
    kind: str                # FULL, SLIDING or STATE
    layers: tuple[str, ...]  # vLLM's layer names, in the group's order
    block_size: int          # vLLM's tokens per block in this group
    state_bytes: int = 0     # STATE: bytes of one layer's state
    signature: str = ""      # STATE: its shapes and dtypes (in the namespace)

    def model_id(self, model_id: str) -> str:
        name = f"{model_id}#kv-group:{self.kind}:{self.index}"
        return f"{name}:{self.signature}" if self.signature else name


class Refused(Exception):
    """The model has KV that kvstore cannot restore exactly (the message names it)."""


def cache_groups(kv_cache_config) -> list[CacheGroup]:
    """vLLM's KV cache groups, each classified by its exact spec type; :class:`Refused` names
    the first group kvstore cannot restore exactly."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    kinds = {FullAttentionSpec: FULL, MLAAttentionSpec: FULL, SlidingWindowSpec: SLIDING, MambaSpec: STATE}
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = kinds.get(type(spec))
        layers = tuple(g.layer_names)
        what = f"KV cache group {i} ({type(spec).__name__}, layers {_names(layers)})"
        if kind is None:
            raise Refused(f"{what} holds {'recurrent state' if 'Mamba' in type(spec).__name__ else 'KV'} "
                          "kvstore cannot restore exactly")
        if kind == STATE:
            if spec.mamba_cache_mode != "align":
                raise Refused(f"{what}: mamba_cache_mode {spec.mamba_cache_mode!r} keeps no state snapshots at "
                              "block boundaries (vLLM's 'align' mode does, with prefix caching on)")
            if spec.num_speculative_blocks:
                raise Refused(f"{what} holds speculative-decoding state blocks kvstore cannot restore exactly")
            out.append(CacheGroup(i, kind, layers, int(spec.block_size), spec.state_content_size_bytes,
                                  state_signature(spec)))
            continue
        out.append(CacheGroup(i, kind, layers, int(spec.block_size)))
    sizes = {g.block_size for g in out}
    if len(sizes) > 1:
        raise Refused(f"KV cache groups of different block sizes ({sorted(sizes)} tokens)")
    if not any(g.kind == FULL for g in out):
        raise Refused("no full-attention KV cache group")
    return out


def _names(layers: tuple[str, ...]) -> str:
    return ", ".join(layers) if len(layers) <= 3 else f"{layers[0]} ... {layers[-1]} ({len(layers)})"


def group_layout(layout: KVLayout, group: CacheGroup) -> KVLayout:
    if group.kind == STATE:
        return state_layout(len(group.layers), group.state_bytes, layout.block_tokens)
    return dataclasses.replace(layout, num_layers=len(group.layers))


def group_span(span: BlockSpan, group: int, bt: int, block_size: int) -> BlockSpan | None:
    """The part of ``span`` that group ``group`` holds: its blocks from the first one after the
    last null block (a sliding window's table is null behind the window). None when it holds
    none. :class:`ValueError` when a held block lies before a null one (no window does that:
    loading around it would leave vLLM reading what nobody wrote)."""
    table = span.tables[group] if span.tables else span.block_table
    first, held_before = span.start, False
    for b in range(span.start, span.end):
        ids = table[b * bt // block_size: -(-(b + 1) * bt // block_size)]
        if len(ids) < -(-bt // block_size) or NULL_BLOCK in ids:
            held_before, first = held_before or first < b, b + 1
    if held_before:
        raise ValueError(f"group {group}: a held block before a null one in blocks {span.start}-{span.end - 1}")
    if first >= span.end:
        return None
    return BlockSpan(span.req_id, span.token_ids, first, span.end, table, span.holder)


# --- the scheduler side -----------------------------------------------------------------------

class HybridScheduler(ConnectorScheduler):
    """The scheduler side for a model of several KV cache groups: Lookup in every group's
    namespace, a hit only as long as every group's, loaded asynchronously (module docstring).
    ``links``: one per group, in vLLM's group order."""

    def __init__(self, settings: ConnectorSettings, groups: list[CacheGroup], links: list[Link], bt: int,
                 can_load: bool, can_save: bool) -> None:
        # Token-row groups first (leading hits), then the state groups (module docstring).
        self._order = sorted(range(len(groups)), key=lambda g: groups[g].kind == STATE)
        super().__init__(settings, links[self._order[0]], bt, can_load, can_save)
        self.groups, self.links = groups, links

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that every group holds (and the policy says to
        load), ``(tokens, True)``: loaded asynchronously. A request back after a failed load
        is not loaded again (it recomputes)."""
        self._matched.pop(request.request_id, None)
        prompt = list(request.prompt_token_ids or [])
        cap = (len(prompt) - 1) // self.bt
        if not self.can_load or cap <= 0 or num_computed_tokens % self.bt or request.request_id in self._pulled:
            return 0, False
        blocks, tiers = cap, b""
        # Token-row groups first (leading hits), then the state groups' snapshots at the
        # boundaries those allow (each key on its own: a state namespace is sparse), over one
        # range for all of them: the hit ends at the last boundary every state group has.
        common: bytearray | None = None
        for g in self._order:
            link, state = self.links[g], self.groups[g].kind == STATE
            client = link.get()
            if client is None:
                return 0, False
            if blocks <= 0:
                return 0, False
            try:
                r = client.lookup_keys(client.keys(prompt[:blocks * self.bt]), ask_peers=False, each=state)
            except KVStoreError as e:
                link.lost(e)
                link.retire()
                return 0, False
            if state:
                found = bytearray(r.found[:blocks].ljust(blocks, b"\0"))
                common = found if common is None else bytearray(a & b for a, b in zip(common, found))
                continue
            blocks = min(blocks, r.hit_blocks, r.load_blocks if self.settings.follow_policy else r.hit_blocks)
            tiers = tiers or bytes(r.tiers)
        if common is not None:
            blocks = max((i + 1 for i, f in enumerate(common) if f), default=0)
        ext = max(0, blocks * self.bt - num_computed_tokens)
        if not ext:
            return 0, False
        self._matched[request.request_id] = _Match(num_computed_tokens, ext, tiers[:blocks])
        return ext, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """The request's load goes to the workers in the next step's ``pulls`` (no peer)."""
        m = self._matched.get(request.request_id)
        if num_external_tokens <= 0 or m is None:
            return
        end = (m.local + num_external_tokens) // self.bt
        tables = tuple(list(t) for t in blocks.get_block_ids())
        self._to_pull[request.request_id] = BlockSpan(
            request.request_id, list(request.prompt_token_ids or [])[:end * self.bt], m.local // self.bt, end,
            list(tables[0]), "", tables)

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        """The step's work (:class:`ConnectorScheduler`), plus the state snapshots vLLM kept
        in this step at boundaries inside a prompt (saved by the state groups' workers)."""
        meta = super().build_connector_meta(scheduler_output)
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        if not self.can_save or state is None:
            return meta
        for req_id, offers in state.boundary_state_offloads.items():
            st = self._reqs.get(req_id)
            for group, block_id, boundary in offers:
                if (st is not None and 0 < boundary <= len(st.prompt) and boundary % self.bt == 0
                        and self.groups[group].kind == STATE):
                    meta.snapshots.append(Snapshot(req_id, group, block_id, st.prompt[:boundary]))
        return meta


class ReuseOff(ConnectorScheduler):
    """The scheduler side for a model kvstore refused: no lookups, no saves (plain vLLM)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        return KVStoreConnectorMetadata()


# --- the worker side ------------------------------------------------------------------------

class GroupWorker(ConnectorWorker):
    """One group's worker: the requests whose load did not wholly land are ``failed``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed: set[str] = set()

    def _end_pull(self, span: BlockSpan, first_block: int, why: str, done: bool = True) -> None:
        if first_block < span.end:
            self.failed.add(span.req_id)
        super()._end_pull(span, first_block, why, done)


class HybridWorker:
    """The worker side for a model of several KV cache groups: one :class:`ConnectorWorker`
    per group (its layers, its session), fed each step's spans cut to what the group holds."""

    state_worker_class = StateWorker   # a state group's worker (a test subclass may name its own)
    group_worker_class = GroupWorker  # a token-row group's worker (likewise)

    def __init__(self, vllm_config, kv_cache_config, settings: ConnectorSettings, groups: list[CacheGroup],
                 links: list[Link], layouts: list[KVLayout], bt: int, roots: list[bytes]) -> None:
        self.groups, self.bt = groups, bt
        self.subs = [self.state_worker_class(link, lay, g.layers, settings.load_wait_s) if g.kind == STATE else
                     self.group_worker_class(vllm_config, kv_cache_config, settings, link, lay, bt, g.block_size, root,
                                             writes=getattr(link.shard, "writes", True))
                     for g, link, lay, root in zip(groups, links, layouts, roots)]
        for sub in self.subs:
            sub.saves_failed = set()
        self._events_from = next(i for i, g in enumerate(groups) if g.kind == FULL)
        self._group_of = {name: i for i, g in enumerate(groups) for name in g.layers}
        self._metas: tuple[object, list[KVStoreConnectorMetadata]] | None = None
        self._pending: dict[str, set[int]] = {}  # request -> groups whose load has not ended
        self._failed: set[str] = set()

    def register_kv_caches(self, kv_caches: dict) -> None:
        missing = [n for n in kv_caches if n not in self._group_of]
        if missing:
            raise ValueError(f"kvstore: vLLM registered KV cache layers in no KV cache group: {_names(tuple(missing))}")
        for g, sub in zip(self.groups, self.subs):
            sub.register_kv_caches({n: kv_caches[n] for n in g.layers})

    def _split(self, meta: KVStoreConnectorMetadata | None) -> list[KVStoreConnectorMetadata | None]:
        """Each group's part of the step's metadata (made once per step)."""
        if meta is None:
            return [None] * len(self.subs)
        if self._metas is not None and self._metas[0] is meta:
            return self._metas[1]
        parts = [KVStoreConnectorMetadata() for _ in self.subs]
        for span in meta.pulls:
            self._pending[span.req_id] = set()
            for g, part in enumerate(parts):
                try:
                    gs = group_span(span, g, self.bt, self.groups[g].block_size)
                    if self.groups[g].kind == STATE and (gs is None or (gs.start, gs.end) != (span.end - 1, span.end)):
                        raise ValueError(f"group {g}: vLLM allocated no single state block at block {span.end - 1}")
                except ValueError as e:
                    log.warning("kvstore load of %s not started; vLLM recomputes it: %s", span.req_id, e)
                    self._failed.add(span.req_id)
                    continue
                if gs is not None:
                    part.pulls.append(gs)
                    self._pending[span.req_id].add(g)
        for snap in meta.snapshots:
            parts[snap.group].snapshots.append(snap)
        for span in meta.saves:
            for g, part in enumerate(parts):
                if self.groups[g].kind == STATE:
                    continue  # a state group saves the snapshots vLLM named (above), not block spans
                try:
                    gs = group_span(span, g, self.bt, self.groups[g].block_size)
                except ValueError:
                    gs = None  # not stored: a later miss in this group, so in all
                if gs is not None:
                    part.saves.append(gs)
        self._metas = (meta, parts)
        return parts

    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        for sub, part in zip(self.subs, self._split(meta)):
            sub.start_load_kv(part)

    def wait_for_layer_load(self, layer_name: str) -> None:
        g = self._group_of.get(layer_name)
        if g is not None:
            self.subs[g].wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, meta: KVStoreConnectorMetadata | None) -> None:
        g = self._group_of.get(layer_name)
        if g is not None:
            self.subs[g].save_kv_layer(layer_name, self._split(meta)[g])

    def wait_for_save(self, meta: KVStoreConnectorMetadata | None) -> None:
        """Every group's saves, the group whose events vLLM publishes last: a request whose save
        failed in any other group has its blocks of this step stored but not announced as
        stored (a router reading the events must not send a prompt here for a prefix that is a
        miss: the scheduler needs every group's part)."""
        parts = self._split(meta)
        failed: set[str] = set()
        order = [g for g in range(len(self.subs)) if g != self._events_from] + [self._events_from]
        for g in order:
            sub = self.subs[g]
            if g == self._events_from:
                sub.unannounced = failed
            sub.wait_for_save(parts[g])
            failed |= sub.saves_failed
            sub.saves_failed = set()
        self.subs[self._events_from].unannounced = set()
        self._metas = None

    def get_transfer_results(self, finished_req_ids: set[str]):
        """Requests whose every group's load ended; those any group failed also in
        ``failed_recving`` (vLLM recomputes them whole)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        for g, sub in enumerate(self.subs):
            _, done = sub.get_finished(finished_req_ids)
            for req_id in done or ():
                self._pending.get(req_id, set()).discard(g)
            self._failed |= sub.failed
            sub.failed.clear()
            sub.get_block_ids_with_load_errors()  # per-group block ids: vLLM takes requests here
        ready = {r for r, left in self._pending.items() if not left}
        for r in ready:
            del self._pending[r]
        failed = self._failed & ready
        self._failed -= ready
        return KVConnectorTransferResults(finished_recving=ready, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # reported by request (get_transfer_results)

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        total = None
        for sub in self.subs:
            s = sub.get_kv_connector_stats()
            if s is None:
                continue
            if total is None:
                total = s
            else:
                for k, v in s.data.items():
                    total.data[k] = total.data.get(k, 0) + v
        return total

    def get_kv_connector_kv_cache_events(self) -> KVStoreKVEvents | None:
        events = None
        for g, sub in enumerate(self.subs):
            ev = sub.get_kv_connector_kv_cache_events()
            if g == self._events_from:
                events = ev
        return events

    def shutdown(self) -> None:
        for sub in self.subs:
            sub.shutdown()


class IdleWorker:
    """The worker side for a model kvstore refused: it copies nothing (plain vLLM)."""

    def register_kv_caches(self, kv_caches: dict) -> None:
        pass

    def start_load_kv(self, meta) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, meta) -> None:
        pass

    def wait_for_save(self, meta) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: set[str]):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        return KVConnectorTransferResults()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_kv_connector_stats(self) -> None:
        return None

    def get_kv_connector_kv_cache_events(self) -> None:
        return None

    def shutdown(self) -> None:
        pass


def hybrid_sides(vllm_config, kv_cache_config, settings: ConnectorSettings, layout: KVLayout, model_id: str,
                 rank: int, tp_world: int, map_arena: bool = True, store_layout: KVLayout | None = None,
                 shard: HeadShard | None = None) -> tuple[list[CacheGroup], list[Link], list[KVLayout], list[bytes]]:
    """Each group's layout (of this rank's pages), session (on rank ``rank``; ``map_arena`` on the
    worker side) and event root (TP rank 0's namespace). ``shard``: at TP > 1, token-row groups
    store blocks of every KV head (``store_layout``) under TP=1's namespace, this rank writing and
    reading its heads (:class:`~kvstore.layout.HeadShard`). State groups whose sharding kvstore
    knows (:func:`~kvstore.clients.vllm_state.state_shard`: Qwen3-Next's gated delta net) store
    whole states under TP=1's namespace likewise, this rank writing and reading its share; any
    other state keeps a namespace per rank."""
    groups = cache_groups(kv_cache_config)
    if settings.transfer_peer:
        raise ValueError("kvstore: transfer_peer is not supported for models of several KV cache groups "
                         f"({len(groups)} here)")
    if settings.kv_codec:
        raise ValueError(f"kvstore: kv_codec {settings.kv_codec} (lossy) is for models of one KV cache group; this "
                         f"model has {len(groups)}, whose state snapshots and windows kvstore restores exactly")
    for g in groups:
        if g.kind == STATE and g.block_size != layout.block_tokens:
            raise Refused(f"KV cache group {g.index} holds state snapshots at vLLM's {g.block_size}-token block "
                          f"boundaries; kv_connector_extra_config's block_tokens {layout.block_tokens} would key "
                          "them elsewhere (leave block_tokens unset)")
    layouts = [group_layout(layout, g) for g in groups]
    links, roots = [], []
    hf = vllm_config.model_config.hf_config if shard is not None else None
    for i, (g, lay) in enumerate(zip(groups, layouts)):
        where = (rank, tp_world, None)
        if shard is not None and g.kind != STATE:
            lay, where = group_layout(store_layout, g), (0, 1, shard)
        elif shard is not None:
            share = state_shard(kv_cache_config.kv_cache_groups[g.index].kv_cache_spec, hf, rank, tp_world)
            if share is not None:
                groups[i] = g = dataclasses.replace(g, state_bytes=share.full_bytes, signature=share.signature)
                layouts[i] = lay = group_layout(layout, g)
                where = (0, 1, share)
        links.append(Link(settings, lay, g.model_id(model_id), where[0], where[1], map_arena, shard=where[2]))
        roots.append(Namespace(g.model_id(model_id), lay, 0, where[1], settings.tenant_salt).root)
    return groups, links, layouts, roots


__all__ = ["CacheGroup", "HybridScheduler", "HybridWorker", "IdleWorker", "Refused", "ReuseOff", "cache_groups", "group_span",
           "hybrid_sides"]
