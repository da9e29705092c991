"""KV events on the wire: vLLM's format (``vllm.distributed.kv_events``), written and read by
kvstore without importing vLLM.

The daemon publishes (:mod:`kvstore.daemon.events`) and the cluster directory reads
(:mod:`kvstore.cluster.stream`) the same bytes vLLM's ``ZmqEventPublisher`` sends, so a router
that reads vLLM's events (llm-d's KV-cache indexer, Dynamo's router, vLLM's own
``kv_events_subscriber.py``) reads kvstore's:

- PUB socket, multipart ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian batch number,
  ``payload`` one msgpack-encoded :class:`KVEventBatch` (an array ``[ts, events, dp_rank]``;
  each event a map tagged ``"type"``).
- Replay ROUTER socket: a request ``[start_seq]`` (8 bytes big-endian) is answered with every
  buffered batch from ``start_seq`` on, each ``("", topic, seq, payload)``, then
  ``("", "", END_SEQ, "")``. A REQ socket sees only the first answer: use DEALER and send
  ``["", start_seq]``.
- kvstore's one addition on that socket: the request :data:`SNAPSHOT_REQUEST` is answered with
  the publisher's whole state as batches (``AllBlocksCleared`` first, then ``BlockStored`` per
  tier), each numbered ``S - 1``, then the end marker: the state after batch ``S - 1``, for a
  subscriber whose gap the replay buffer no longer covers. vLLM's publisher ignores it.

Tiers as ``medium``, by vLLM's constants: HBM -> ``"GPU"``, DRAM -> ``"CPU"``, NVMe ->
``"STORAGE"`` (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``; vLLM's OffloadingConnector
names its disk tier ``STORAGE`` too). ``ownership`` is ``"kvstore"`` (vLLM: "secondary offloading
tier identifier"), so a router that also reads the engines' own events can tell the two apart.
Block hashes are kvstore's 32-byte keys (vLLM's ``ExternalBlockHash`` is bytes or int); routers
that hash tokens their own way use ``token_ids`` (the block's token ids, when the writer sent
them) and ``extra_keys`` (the tenant salt per block, as vLLM carries its ``cache_salt``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvstore.tier_kind import TierKind

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
MEDIUM = {TierKind.HBM: MEDIUM_GPU, TierKind.DRAM: MEDIUM_CPU, TierKind.NVME: MEDIUM_STORAGE}
TIER_OF_MEDIUM = {m: t for t, m in MEDIUM.items()}
OWNERSHIP = "kvstore"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT_REQUEST = b"kvstore-snapshot"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """A run of chained blocks now held in ``medium``: ``parent_block_hash`` is the key before
    ``block_hashes[0]`` (None at a chain root), ``token_ids`` the tokens of every block in
    order (empty when the writer did not send them), ``block_size`` tokens per block."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A batch number from its 8-byte frame; -1 for the replay's end marker."""
    return int.from_bytes(frame, "big", signed=True)


def stored_events(items, medium: str) -> list[BlockStored]:
    """``BlockStored`` events for ``items``, each ``(key, parent_key, tokens, block_tokens,
    salt)`` (``tokens`` int32 little-endian bytes or None), in the order they happened: runs of
    one chain (each block the child of the one before, same namespace geometry, tokens known
    for all or none) share one event, as vLLM sends a request's new blocks."""
    out: list[BlockStored] = []
    run: list = []

    def flush() -> None:
        if not run:
            return
        key0, parent, tokens0, bt, salt = run[0]
        token_ids: list[int] = []
        if tokens0 is not None:
            token_ids = np.frombuffer(b"".join(it[2] for it in run), "<i4").tolist()
        out.append(BlockStored(block_hashes=[it[0] for it in run], parent_block_hash=parent, token_ids=token_ids,
                               block_size=bt, lora_id=None, medium=medium, lora_name=None,
                               extra_keys=[(salt,)] * len(run) if salt else None, ownership=OWNERSHIP))
        run.clear()

    for it in items:
        if run:
            last = run[-1]
            if not (it[1] == last[0] and it[3] == last[3] and it[4] == last[4]
                    and (it[2] is None) == (last[2] is None)):
                flush()
        run.append(it)
    flush()
    return out


def removed_event(keys: list[bytes], medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=keys, medium=medium, ownership=OWNERSHIP)


def decoder() -> msgspec.msgpack.Decoder:
    """A decoder of payloads into :class:`KVEventBatch` (one per thread: decoders are not
    shared across threads)."""
    return msgspec.msgpack.Decoder(type=KVEventBatch)
