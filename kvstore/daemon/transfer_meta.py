"""What a daemon-to-daemon transfer says about its blocks, in the transport header's opaque
``meta`` (at most ``max_meta_bytes``, 64 KiB, plus 64 bytes per key: ``protocol.meta_limit``):
their namespace and, when the sender knows them, their token ids and the chain parent of the
first, for the receiver's KV events.

The form: the namespace as JSON (:meth:`Namespace.to_dict`) alone; or followed by a NUL byte
(JSON text never holds one), one byte giving the parent key's length (0: the first block is a
chain root, or 32), that key, and every block's token ids (int32 little-endian,
``block_tokens`` a block). The sender writes them only when it holds every block's tokens, the
blocks are one run of a chain, and they fit the bound: blocks of up to 16 tokens (vLLM's
default) always fit, whatever the transfer's length; larger blocks while their tokens beyond 16
a block fit the 64 KiB (e.g. about 1,000 blocks of 32 tokens, 16 of 1,024). Any other transfer
(keys from several chains, blocks from a daemon that publishes no events and so keeps no tokens,
larger blocks past that) carries the namespace alone, and its blocks are announced on the
receiver without token ids (docs/cluster.md, "KV events").

A receiver trusts none of it unchecked: the tokens must chain, after the parent, to the keys
(:func:`kvstore.keys.check_tokens`), which also vouches for the parent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.daemon.index import Block
from kvstore.keys import KEY_BYTES, Namespace

_SEP = b"\0"


@dataclass(frozen=True, slots=True)
class TransferMeta:
    ns: Namespace
    parent: bytes = b""  # chain parent of the first block (b"": a root, or not sent)
    tokens: bytes = b""  # every block's token ids, int32 LE (b"": not sent)


def encode(ns: Namespace, blocks: Sequence[Block], limit: int) -> bytes:
    """The meta of a transfer of ``blocks`` of ``ns``, at most ``limit`` bytes. The token ids
    go only when every block has them, the blocks are one run of a chain (each the child of the
    one before: the receiver checks them as one) and they fit; else the namespace goes alone.
    A block's key, parent and tokens never change, so this reads them without the core lock."""
    meta = json.dumps(ns.to_dict()).encode()
    if not blocks or any(b.tokens is None for b in blocks) or \
            any(b.parent_key != a.key for a, b in zip(blocks, blocks[1:])):
        return meta
    parent = blocks[0].parent_key or b""
    if len(meta) + 2 + len(parent) + sum(len(b.tokens) for b in blocks) > limit:
        return meta
    return b"".join((meta, _SEP, bytes((len(parent),)), parent, *(b.tokens for b in blocks)))


def decode(meta: bytes) -> TransferMeta:
    """Parse :func:`encode`'s form; ValueError saying what is wrong. The tokens are not checked
    against the keys here (the receiver does, with the transfer's keys)."""
    text, sep, rest = meta.partition(_SEP)
    try:
        ns = Namespace.from_dict(json.loads(text))
    except ValueError as e:  # not JSON (UnicodeDecodeError and JSONDecodeError are ValueErrors), or not a namespace
        raise ValueError(f"not a namespace: {e}") from None
    if not sep:
        return TransferMeta(ns)
    if not rest or rest[0] not in (0, KEY_BYTES):
        raise ValueError(f"parent key of {rest[0] if rest else 'no'} bytes, want 0 or {KEY_BYTES}")
    parent, tokens = rest[1:1 + rest[0]], rest[1 + rest[0]:]
    if not tokens:
        raise ValueError("token ids announced but none sent")
    return TransferMeta(ns, bytes(parent), bytes(tokens))
