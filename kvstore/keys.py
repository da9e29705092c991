"""Block keys: SHA-256 chains over token ids, rooted in the namespace.

``key_0 = H(namespace_root, tokens_0)``, ``key_i = H(key_{i-1}, tokens_i)`` with the token ids
of block ``i`` encoded as int32 little-endian. Only full blocks get keys. Client and daemon both
call :func:`chain_keys`; no Python ``hash()`` and no seed, so a key means the same thing in
every process on every node.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import NewType, Sequence

import numpy as np

from kvstore.layout import BLOCK_FORMAT, KVLayout, LayoutError

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 32


_FIELD_TYPES = {"model_id": str, "layout": dict, "tp_rank": int, "tp_world": int, "tenant_salt": str}
KV_CODECS = ("", "int8", "fp8")  # "": blocks read back exact; else kvstore.lossy's codec on NVMe


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that must keep two caches apart: model, layout, TP shard and tenant, and
    ``kv_codec``: a lossy codec the namespace opted into (``int8`` or ``fp8``: its blocks are
    stored quantized on NVMe, :mod:`kvstore.lossy`), or "" for blocks always read back exact.
    A lossy namespace has another id than the exact one of the same model: a reader that asked
    for exact blocks never gets lossy ones."""

    model_id: str
    layout: KVLayout
    tp_rank: int = 0
    tp_world: int = 1
    tenant_salt: str = ""
    kv_codec: str = ""

    def __post_init__(self) -> None:
        if not self.model_id or len(self.model_id) > 256:
            raise LayoutError("model_id: must be 1 to 256 characters")
        if self.tp_world < 1 or not 0 <= self.tp_rank < self.tp_world:
            raise LayoutError(f"tp_rank: must be in [0, tp_world={self.tp_world}), got {self.tp_rank}")
        if self.kv_codec not in KV_CODECS:
            raise LayoutError(f"kv_codec: expected int8, fp8 or empty (exact), got {self.kv_codec!r}")
        if self.kv_codec and self.layout.dtype.label not in ("bf16", "fp16", "fp32"):
            raise LayoutError(f"kv_codec: {self.kv_codec} quantizes bf16, fp16 or fp32 KV, not {self.layout.dtype.label}")

    def to_dict(self) -> dict:
        """The namespace as plain JSON values; :meth:`from_dict` reads it back. The one form in
        which a namespace is written down (NVMe recovery file, transfer headers, the hash)."""
        d = {"model_id": self.model_id, "layout": self.layout.to_dict(), "tp_rank": self.tp_rank,
             "tp_world": self.tp_world, "tenant_salt": self.tenant_salt}
        if self.kv_codec:  # only then: every exact namespace keeps the id it had before
            d["kv_codec"] = self.kv_codec
        return d

    @classmethod
    def from_dict(cls, d) -> "Namespace":
        """Parse :meth:`to_dict`'s form, as read from a file or a peer. Every field is required
        and an unknown one is refused (each is inside the hash: one dropped would name another
        namespace). Raises :class:`LayoutError` (a ValueError) naming the bad field."""
        if not isinstance(d, dict):
            raise LayoutError(f"namespace: must be an object, got {type(d).__name__}")
        unknown = set(d) - set(_FIELD_TYPES) - {"kv_codec"}
        if unknown:
            raise LayoutError(f"namespace.{sorted(unknown)[0]}: unknown field")
        for name, kind in _FIELD_TYPES.items():
            if name not in d:
                raise LayoutError(f"namespace.{name}: missing")
            if not isinstance(d[name], kind) or isinstance(d[name], bool):
                raise LayoutError(f"namespace.{name}: must be {kind.__name__}, got {d[name]!r}")
        try:
            layout = KVLayout.from_dict(d["layout"])
        except TypeError as e:  # a field of the wrong type that KVLayout's checks do not name
            raise LayoutError(f"namespace.layout: {e}") from None
        except LayoutError as e:
            raise LayoutError(f"namespace.layout.{e}") from None
        codec = d.get("kv_codec", "")
        if not isinstance(codec, str) or d.get("kv_codec", None) == "":
            raise LayoutError(f"namespace.kv_codec: must be int8 or fp8 where present, got {codec!r}")
        try:
            return cls(d["model_id"], layout, d["tp_rank"], d["tp_world"], d["tenant_salt"], codec)
        except LayoutError as e:
            raise LayoutError(f"namespace.{e}") from None

    def canonical(self) -> bytes:
        return json.dumps({"v": 1, **self.to_dict(), "block_format": BLOCK_FORMAT}, sort_keys=True).encode()

    @property
    def root(self) -> bytes:
        """32-byte chain root; doubles as the namespace id."""
        return _root(self, BLOCK_FORMAT)


@functools.lru_cache(maxsize=1024)
def _root(ns: Namespace, block_format: str) -> bytes:
    # Computed once per namespace (and block format, which canonical() writes): every chain of
    # keys starts here (measured: 0.13 ms a call, in a vLLM step that asks for it three times).
    return hashlib.sha256(b"kvstore-ns-v1\0" + ns.canonical()).digest()


def chain_keys(root: bytes, token_ids: Sequence[int] | np.ndarray, block_tokens: int,
               parent: bytes | None = None) -> list[BlockKey]:
    """Keys of every full block of ``token_ids``; a trailing partial block gets none.

    ``parent`` continues an existing chain (the key of the block before ``token_ids[0]``).
    """
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError("token_ids: must be one-dimensional")
    if tokens.size and (tokens.min() < -(2**31) or tokens.max() >= 2**31):
        raise ValueError("token_ids: every id must fit in int32")
    raw = tokens.astype("<i4", copy=False).tobytes()
    step = 4 * block_tokens
    prev = parent if parent is not None else root
    keys: list[BlockKey] = []
    for off in range(0, (len(tokens) // block_tokens) * step, step):
        prev = hashlib.sha256(prev + raw[off:off + step]).digest()
        keys.append(BlockKey(prev))
    return keys


def check_key(key: bytes) -> BlockKey:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
        raise ValueError(f"key: must be {KEY_BYTES} bytes, got {len(key) if hasattr(key, '__len__') else key!r}")
    return BlockKey(bytes(key))


def engine_keys(root: bytes, engine_keys: Sequence[bytes]) -> list[BlockKey]:
    """Keys for blocks an engine names by its own hashes (SGLang HiCache pages, LMCache
    chunks): ``H(root, "engine", key)``. Those hashes cover token ids but not the model, layout,
    TP shard or tenant, so rooting each one in the namespace is what keeps tenants and models
    apart. They never equal :func:`chain_keys`' keys: an engine's tier shares blocks with
    itself, not with kvstore's own connectors."""
    return [BlockKey(hashlib.sha256(root + b"\0engine\0" + bytes(k)).digest()) for k in engine_keys]


def check_token_count(n_keys: int, tokens: bytes, block_tokens: int) -> None:
    """Raise ValueError unless ``tokens`` is ``block_tokens`` int32 token ids for each of
    ``n_keys`` keys (no hashing: :func:`check_tokens` checks what they stand for)."""
    if len(tokens) != n_keys * 4 * block_tokens:
        raise ValueError(f"token_ids: {len(tokens)} bytes, but {n_keys} keys of {block_tokens} tokens need "
                         f"{n_keys * 4 * block_tokens} (int32 little-endian, or empty)")


def check_tokens(root: bytes, parent: bytes, packed_keys: bytes, tokens: bytes, block_tokens: int) -> None:
    """Check that ``tokens`` (int32 LE, ``block_tokens`` per key) are the token ids the packed
    32-byte ``packed_keys`` were chained from, after ``parent`` (or ``root``); raises ValueError
    saying which key does not match. A writer's token ids reach routers through the KV events,
    so they must be the ones its keys stand for."""
    step = 4 * block_tokens
    n = len(packed_keys) // KEY_BYTES
    check_token_count(n, tokens, block_tokens)
    prev = parent or root
    for i in range(n):
        prev = hashlib.sha256(prev + tokens[i * step:(i + 1) * step]).digest()
        if prev != packed_keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]:
            raise ValueError(f"token_ids: the tokens of block {i} do not hash to key {i} "
                             "(chain_keys over the namespace root, after parent)")
