"""kvstore as the lower tier of an engine's own offloading framework (SGLang HiCache, LMCache L2).

Those engines name blocks by their own hashes and bring their own buffers; this module is the part
both adapters share: where the daemon is, the tenant salt, the namespace keys, and the three
moves with the guarantees their users ask of a lower tier:

- ``store``: reserve, copy into the reserved slots, Commit. Until Commit a block is RESERVED and
  no Lookup or Acquire sees it; a copy or Commit that fails aborts the lease (or the daemon drops
  it at its TTL when even Abort cannot be sent), so a failed store is never visible.
- ``load``: copies only out of blocks pinned by its own read lease (Acquire), released after the
  copy. A block evicted after the engine's ``exists`` is a miss, never another block's bytes.
  NVMe reads are checked against their checksums in the daemon; a corrupt block is a miss.
- every RPC has a deadline (``timeout_s``), promotions from NVMe wait at most ``load_wait_s``.

An engine key is rooted in the namespace (:func:`kvstore.keys.engine_keys`), so the model,
layout, TP shard and tenant salt keep caches apart as they do kvstore's own keys.

Not thread-safe: one :class:`EngineStore` per thread (a KVStoreClient is one session).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import grpc
import numpy as np

from kvstore.clients.client import KVStoreClient, default_socket_path
from kvstore.clients.leases import RESERVED, KVStoreError, ReadLease
from kvstore.keys import BlockKey, engine_keys
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb

log = logging.getLogger("kvstore.engine")


class EngineTierConfigError(ValueError):
    """The adapter's configuration is wrong; the message names the field."""


class DaemonUnreachable(ConnectionError):
    """No kvstore daemon answers at the configured socket."""


_TARGET_FIELDS = {"socket_path", "timeout_s", "load_wait_s", "tenant_salt", "tenant_salt_file"}


@dataclass(frozen=True)
class DaemonTarget:
    """Where the daemon is and how long to wait for it. ``timeout_s`` bounds every RPC (seconds);
    ``load_wait_s`` bounds a load's wait for blocks promoted from NVMe (seconds)."""

    socket_path: str
    timeout_s: float = 5.0
    load_wait_s: float = 1.0
    tenant_salt: str = field(default="", repr=False)  # a secret: never logged

    @classmethod
    def from_params(cls, params: Mapping | None, who: str, others: set[str] | None = frozenset()) -> "DaemonTarget":
        """Read the adapter's settings. ``others``: the engine's own keys that may share the
        mapping (None: any); any other key is refused, so a typo is not silently ignored."""
        params = dict(params or {})
        if others is not None:
            unknown = sorted(set(params) - _TARGET_FIELDS - set(others))
            if unknown:
                raise EngineTierConfigError(f"{who}: unknown setting {unknown[0]!r}; known: {sorted(_TARGET_FIELDS)}")
        socket_path = params.get("socket_path") or default_socket_path()
        if not isinstance(socket_path, str):
            raise EngineTierConfigError(f"{who}.socket_path: must be a path, got {socket_path!r}")
        times = {}
        for name in ("timeout_s", "load_wait_s"):
            value = params.get(name, getattr(cls, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise EngineTierConfigError(f"{who}.{name}: must be seconds in (0, 3600], got {value!r}")
            times[name] = float(value)
        return cls(socket_path, tenant_salt=_salt(params, who), **times)

    def connect(self, prefault: bool = False) -> KVStoreClient:
        """A client whose daemon answered within ``timeout_s``; DaemonUnreachable if none did.
        ``prefault``: fault the arena mapping in now (a session that copies blocks)."""
        client = KVStoreClient(self.socket_path, timeout_s=self.timeout_s, prefault=prefault)
        try:
            grpc.channel_ready_future(client.channel).result(timeout=self.timeout_s)
        except grpc.FutureTimeoutError:
            client.close()
            hint = "" if os.path.exists(self.socket_path) else " (no such socket: is `kvstore serve` running?)"
            raise DaemonUnreachable(f"kvstore daemon at {self.socket_path} did not answer within "
                                    f"{self.timeout_s:g} s{hint}; set socket_path") from None
        return client


def _salt(params: dict, who: str) -> str:
    inline, path = params.get("tenant_salt"), params.get("tenant_salt_file")
    if inline is not None and path is not None:
        raise EngineTierConfigError(f"{who}: set tenant_salt or tenant_salt_file, not both")
    if path is None:
        if inline is not None and not isinstance(inline, str):
            raise EngineTierConfigError(f"{who}.tenant_salt: must be a string")
        return inline or ""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            salt = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise EngineTierConfigError(f"{who}.tenant_salt_file: cannot read {path}: "
                                    f"{getattr(e, 'strerror', None) or e}") from None
    if not salt:
        raise EngineTierConfigError(f"{who}.tenant_salt_file: {path} is empty; the tenant salt is missing")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EngineTierConfigError(f"{who}.tenant_salt_file: {path} is readable by others "
                                    f"(mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it")
    return salt


Copier = Callable[[int, np.ndarray], None]  # (index in the batch, the block's uint8 slot view)


class EngineStore:
    """One namespace on one daemon, addressed by the engine's own keys (bytes)."""

    def __init__(self, target: DaemonTarget, layout: KVLayout, model_id: str, tp_rank: int = 0, tp_world: int = 1,
                 *, prefault: bool = False) -> None:
        self.target = target
        self.client = target.connect(prefault)
        try:
            self.client.register(layout, model_id, tp_rank=tp_rank, tp_world=tp_world, tenant_salt=target.tenant_salt)
        except BaseException:
            self.client.close()
            raise
        self.layout = layout
        self.max_batch = self.client.max_batch_blocks()

    def keys(self, engine_keys_: Sequence[bytes]) -> list[BlockKey]:
        return engine_keys(self.client.namespace.root, engine_keys_)

    def prefix_hits(self, keys: Sequence[BlockKey]) -> tuple[int, int]:
        """(leading blocks committed, leading blocks the daemon advises loading rather than
        recomputing)."""
        hit = load = 0
        advised = True  # the advice covers every block up to here
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start:start + self.max_batch]
            r = self.client.lookup_keys(chunk)
            if advised:
                load += r.load_blocks
                advised = r.load_blocks == len(chunk)
            hit += r.hit_blocks
            if r.hit_blocks < len(chunk):
                break
        return hit, load

    def store(self, keys: Sequence[BlockKey], fill: Copier, parent: bytes = b"") -> list[bool]:
        """Store blocks: ``fill(i, slot)`` writes block i into its reserved slot. Returns, per
        key, whether it is committed now (newly, or already present). A block another writer
        holds (BUSY) is False: it is not ours to vouch for."""
        done: list[bool] = []
        for start, w in self.client.reserve_chain([bytes(k) for k in keys], parent=parent,
                                                  retry_s=self.target.timeout_s, batch_blocks=self.max_batch):
            with w:
                for i, state in enumerate(w.states):
                    if state == RESERVED:
                        fill(start + i, w.view(i))
            done += [s in (RESERVED, pb.SLOT_PRESENT) for s in w.states]
        return done

    def load(self, keys: Sequence[BlockKey], drain: Copier) -> int:
        """Copy the longest stored prefix of ``keys`` out: ``drain(i, slot)`` reads block i from
        its pinned slot. Returns how many leading blocks were copied."""
        read = 0
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start:start + self.max_batch]
            with self.pin(chunk) as r:
                for i in range(r.count):
                    drain(start + i, r.view(i))
            read += r.count
            if r.count < len(chunk):
                break
        return read

    def pin(self, keys: Sequence[BlockKey]) -> ReadLease:
        """A read lease on the leading stored blocks of ``keys`` (``count`` of them); while it
        lives they are neither evicted nor moved."""
        return self.client.acquire(keys, allow_partial=True, wait_s=self.target.load_wait_s)

    def close(self) -> None:
        self.client.close()


def failed(e: BaseException) -> bool:
    """Log a failed move the engine treats as a miss or a failed store (it recomputes)."""
    if isinstance(e, KVStoreError):
        log.warning("kvstore: %s", e)
    else:
        log.warning("kvstore: %s: %s", type(e).__name__, e)
    return False
