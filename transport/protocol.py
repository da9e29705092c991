"""The wire protocol both backends speak: fixed-size frame headers, the transfer manifest, the
per-chunk checksum and the status codes a failed transfer reports.

One connection carries one transfer at a time::

    sender                                   receiver
    HELLO x 4: the handshake (auth.py)  <-->                     (TCP frames; UCX: its stream API)
    BEGIN(transfer id, manifest) ---------->  sink.begin()
                               <------------ ACCEPT | REFUSE(status, why)
    CHUNK(seq, block, layer, key, length, xxh3) + payload ---->  verify, target.arrived()
    BATCH(CHUNK, CHUNK, ...) + payloads --->  (UCX only: several CHUNK headers in one message)
    ...                        <------------ ERROR(status, why)  (any time; then it closes)
    END(chunk count) ---------------------->  target.end(OK)
                               <------------ RESULT(status, why)
    ABORT(why) ---------------------------->  target.end(ABORTED)   (instead of END)

A chunk is one layer of one block: ``header.chunk_bytes`` contiguous bytes. Its xxh3-64 is
computed by the sender over the source buffer and checked by the receiver over the bytes that
landed in the destination, so both memory and wire corruption are caught.

Encoded chunks (:mod:`kvstore.codec`): a sender that may encode sets :data:`BEGIN_ENCODED` in
BEGIN's ``flags``; a receiver that decodes answers with the codecs it takes as a bit mask in
ACCEPT's ``flags`` (:data:`DECODES`; an older receiver answers 0, and gets raw chunks). An
encoded CHUNK names its codec in ``status`` and carries ``length`` bytes of payload for its
``k`` layers (``flags`` = k for a run, 0 for one layer, as for a raw one); its checksum and
digests are those of the raw layers, checked after the decode.

A CHUNK frame may carry a *run*: ``k`` consecutive layers of one block that are contiguous on the
sender (``length = k * chunk_bytes``, ``layer`` = the first, ``flags = k``). Its header is followed
by the ``k`` per-layer xxh3-64 digests (little-endian u64) and its checksum is
:func:`run_checksum` of them, so every layer keeps its own xxh3 (what the daemon records and the
NVMe tier stores, and what a mismatch is reported against) while a whole block travels as one
message.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

MAGIC = 0x3154564B  # b"KVT1" little-endian
VERSION = 3  # 2: BATCH frames; 3: the authenticated handshake
MAX_BATCH = 64  # CHUNK headers one BATCH frame may carry
BATCH_BYTES = 64 << 10  # ... and at most this many bytes of headers and run digests
MAX_RUN_LAYERS = 1024  # layers one run may carry
KEY_BYTES = 32
BEGIN_ENCODED = 1  # BEGIN.flags: the sender may send encoded chunks
DECODES = (1 << 1) | (1 << 2)  # ACCEPT.flags of a receiver that decodes: kvstore.codec.Codec 1 and 2
# Room a manifest's meta gets per key on top of ``max_meta_bytes``: 16 int32 token ids, one block
# of vLLM's default size, so a transfer of any length can carry its blocks' token ids for the
# receiver's KV events (the daemon's use of meta, kvstore/daemon/transfer_meta.py).
META_BYTES_PER_KEY = 64

# magic, version, type, flags, status, seq, transfer_id, block, layer, length, checksum, key:
# every field naturally aligned, 80 bytes
_FRAME = struct.Struct("<IBBHIIQIIQQ32s")
FRAME_BYTES = _FRAME.size
_MANIFEST = struct.Struct("<IIQdI")  # n_blocks, n_layers, chunk_bytes, deadline_s, meta_len
_ZERO_KEY = bytes(KEY_BYTES)


def checksum(buf) -> int:
    """xxh3-64 of a buffer (bytes, memoryview or C-contiguous numpy array); releases the GIL."""
    return xxhash.xxh3_64_intdigest(buf)


def layer_digests(buf, chunk_bytes: int) -> list[int]:
    """The xxh3-64 of each ``chunk_bytes`` piece of a run."""
    mv = memoryview(buf).cast("B")
    return [checksum(mv[off:off + chunk_bytes]) for off in range(0, mv.nbytes, chunk_bytes)]


def payload_digests(frame: "Frame", buf) -> int | list[int]:
    """What arrived for a validated CHUNK ``frame``: the payload's xxh3-64, or for a run (``flags``
    = k layers) the list of its layers' xxh3-64s. Pure: safe on any thread."""
    return checksum(buf) if not frame.flags else layer_digests(buf, frame.length // frame.flags)


def pack_digests(digests) -> bytes:
    """A run's layer digests as they follow its CHUNK header."""
    return struct.pack(f"<{len(digests)}Q", *digests)


def unpack_digests(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}Q", raw))


def run_checksum(digests) -> int:
    """A CHUNK frame's checksum for a run of layers with these per-layer digests: the digest
    itself for one layer, else the xxh3-64 of the digests as little-endian u64s."""
    if len(digests) == 1:
        return digests[0]
    return xxhash.xxh3_64_intdigest(pack_digests(digests))


class FrameType(enum.IntEnum):
    HELLO = 1
    BEGIN = 2
    ACCEPT = 3
    REFUSE = 4
    CHUNK = 5
    END = 6
    RESULT = 7
    ABORT = 8
    ERROR = 9
    BATCH = 10  # data: 1..MAX_BATCH CHUNK frame headers, each followed on the wire by its payload


class TransferStatus(enum.IntEnum):
    """Outcome of a transfer, the same on both ends and on the wire."""

    OK = 0
    REFUSED = 1             # the receiving sink had no room (back-pressure) or declined
    CHECKSUM_MISMATCH = 2   # a chunk arrived corrupted; nothing of the transfer is kept
    PEER_LOST = 3           # the other side closed, crashed or reset the connection
    DEADLINE_EXCEEDED = 4
    PROTOCOL_ERROR = 5      # malformed or out-of-order frame, bad sizes, wrong version or token
    ABORTED = 6             # the sender gave up (its caller aborted)
    SINK_ERROR = 7          # the receiving sink raised
    SHUTDOWN = 8            # the listener or sender is stopping
    CONNECT_FAILED = 9      # no connection to the peer could be made
    UNAUTHENTICATED = 10    # the handshake failed: no or wrong credentials on one side
    FORBIDDEN = 11          # the receiver does not accept this namespace from this sender

    @property
    def grpc_code(self) -> str:
        """Name of the gRPC status code a daemon should answer with."""
        return _GRPC[self]


_GRPC = {
    TransferStatus.OK: "OK", TransferStatus.REFUSED: "RESOURCE_EXHAUSTED",
    TransferStatus.CHECKSUM_MISMATCH: "DATA_LOSS", TransferStatus.PEER_LOST: "UNAVAILABLE",
    TransferStatus.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED", TransferStatus.PROTOCOL_ERROR: "INTERNAL",
    TransferStatus.ABORTED: "ABORTED", TransferStatus.SINK_ERROR: "INTERNAL",
    TransferStatus.SHUTDOWN: "UNAVAILABLE", TransferStatus.CONNECT_FAILED: "UNAVAILABLE",
    # The Transfer RPC's caller is this daemon's client: the peer refusing this daemon is a
    # permission it lacks, whichever of the two refusals it was.
    TransferStatus.UNAUTHENTICATED: "PERMISSION_DENIED", TransferStatus.FORBIDDEN: "PERMISSION_DENIED",
}


class TransferError(Exception):
    """A transfer failed; ``status`` says how, ``detail`` says what a user can act on."""

    def __init__(self, status: TransferStatus, detail: str, transfer_id: int = 0) -> None:
        super().__init__(f"{status.name}: {detail}")
        self.status = status
        self.detail = detail
        self.transfer_id = transfer_id


class ProtocolError(TransferError):
    def __init__(self, detail: str, transfer_id: int = 0) -> None:
        super().__init__(TransferStatus.PROTOCOL_ERROR, detail, transfer_id)


@dataclass(frozen=True, slots=True)
class Frame:
    type: FrameType
    transfer_id: int = 0
    seq: int = 0
    block: int = 0
    layer: int = 0
    length: int = 0     # bytes of data following the header (payload, manifest or reason text)
    checksum: int = 0
    key: bytes = _ZERO_KEY
    status: int = 0
    flags: int = 0      # CHUNK: the number of run digests following the header (0: one layer)
    # (CHUNK.status: the codec of an encoded payload, 0 = raw; BEGIN/ACCEPT.flags: see the docstring)

    @property
    def trailer_bytes(self) -> int:
        """Bytes that follow the header of a CHUNK before its payload: a run's layer digests."""
        return 8 * self.flags if self.type is FrameType.CHUNK else 0

    def pack(self, checksum: int | None = None) -> bytes:
        """Wire bytes; ``checksum`` overrides the field (senders hash just before sending)."""
        return _FRAME.pack(MAGIC, VERSION, self.type, self.flags, self.status, self.seq, self.transfer_id,
                           self.block, self.layer, self.length,
                           self.checksum if checksum is None else checksum, self.key)

    @classmethod
    def unpack(cls, raw) -> "Frame":
        if len(raw) != FRAME_BYTES:
            raise ProtocolError(f"frame header: expected {FRAME_BYTES} bytes, got {len(raw)}")
        magic, version, ftype, flags, status, seq, tid, block, layer, length, csum, key = _FRAME.unpack(raw)
        if magic != MAGIC:
            raise ProtocolError(f"frame header: bad magic {magic:#x} (not a kvstore transport peer?)")
        if version != VERSION:
            raise ProtocolError(f"frame header: protocol version {version}, this side speaks {VERSION}")
        try:
            ftype = FrameType(ftype)
        except ValueError:
            raise ProtocolError(f"frame header: unknown frame type {ftype}") from None
        return cls(ftype, tid, seq, block, layer, length, csum, key, status, flags)


def pack_batch(entries) -> bytes:
    """The data of a BATCH frame: each (CHUNK frame, run digests) entry, header then digests."""
    return b"".join(frame.pack() + trailer for frame, trailer in entries)


def split_batch(data: bytes) -> list[tuple[Frame, bytes]]:
    """The (CHUNK frame, run digests) entries of a BATCH frame's data; ProtocolError unless it
    is 1..MAX_BATCH whole CHUNK entries."""
    entries, off = [], 0
    while off + FRAME_BYTES <= len(data) and len(entries) < MAX_BATCH:
        chunk = Frame.unpack(data[off:off + FRAME_BYTES])
        if chunk.type is not FrameType.CHUNK:
            raise ProtocolError("BATCH may only carry CHUNK frames")
        end = off + FRAME_BYTES + chunk.trailer_bytes
        if end > len(data):
            break
        entries.append((chunk, data[off + FRAME_BYTES:end]))
        off = end
    if not entries or off != len(data):
        raise ProtocolError(f"BATCH of {len(data)} bytes: not 1..{MAX_BATCH} whole CHUNK entries")
    return entries


def status_frame(ftype: FrameType, transfer_id: int, status: TransferStatus, detail: str = "") -> tuple[Frame, bytes]:
    """A REFUSE / ERROR / RESULT / ABORT frame and its reason text (UTF-8, at most 4 KiB)."""
    text = detail.encode()[:4096]
    return Frame(ftype, transfer_id, length=len(text), status=int(status)), text


def parse_status(frame: Frame, data: bytes) -> TransferError | None:
    """The error a status-bearing frame reports, or None for OK."""
    try:
        status = TransferStatus(frame.status)
    except ValueError:
        status = TransferStatus.PROTOCOL_ERROR
    if status is TransferStatus.OK and frame.type in (FrameType.RESULT, FrameType.ACCEPT):
        return None
    if status is TransferStatus.OK:  # an ERROR/REFUSE/ABORT frame always means failure
        status = TransferStatus.PROTOCOL_ERROR
    return TransferError(status, f"peer: {bytes(data).decode(errors='replace') or status.name}",
                         frame.transfer_id)


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """What a BEGIN frame announces: ``len(keys) * n_layers`` chunks of ``chunk_bytes`` each.

    ``deadline_s`` is relative (seconds from arrival) because clocks of two nodes differ.
    ``meta`` is opaque to the transport (namespace id, request id: the daemon's business).
    """

    transfer_id: int
    keys: tuple[bytes, ...]
    n_layers: int
    chunk_bytes: int
    deadline_s: float
    meta: bytes = b""

    @property
    def n_chunks(self) -> int:
        return len(self.keys) * self.n_layers

    @property
    def total_bytes(self) -> int:
        return self.n_chunks * self.chunk_bytes

    def encode(self) -> bytes:
        return b"".join((_MANIFEST.pack(len(self.keys), self.n_layers, self.chunk_bytes,
                                        self.deadline_s, len(self.meta)), *self.keys, self.meta))

    @classmethod
    def decode(cls, transfer_id: int, raw: bytes, max_blocks: int, max_chunk_bytes: int,
               max_meta_bytes: int) -> "TransferHeader":
        """Parse and bound-check a manifest; raises ProtocolError naming the bad field."""
        if len(raw) < _MANIFEST.size:
            raise ProtocolError("manifest: truncated", transfer_id)
        n_blocks, n_layers, chunk_bytes, deadline_s, meta_len = _MANIFEST.unpack_from(raw)
        if not 0 < n_blocks <= max_blocks:
            raise ProtocolError(f"manifest: {n_blocks} keys, allowed 1..{max_blocks}", transfer_id)
        if not 0 < n_layers <= 65536:
            raise ProtocolError(f"manifest: {n_layers} layers, allowed 1..65536", transfer_id)
        if not 0 < chunk_bytes <= max_chunk_bytes:
            raise ProtocolError(f"manifest: chunk of {chunk_bytes} bytes, allowed 1..{max_chunk_bytes}",
                                transfer_id)
        if meta_len > meta_limit(max_meta_bytes, n_blocks):
            raise ProtocolError(f"manifest: {meta_len} bytes of meta, allowed {meta_limit(max_meta_bytes, n_blocks)} "
                                f"({max_meta_bytes} + {META_BYTES_PER_KEY} per key)", transfer_id)
        if len(raw) != _MANIFEST.size + n_blocks * KEY_BYTES + meta_len:
            raise ProtocolError("manifest: length does not match its key count", transfer_id)
        if not deadline_s > 0:
            raise ProtocolError(f"manifest: deadline {deadline_s} s is not positive", transfer_id)
        off = _MANIFEST.size
        keys = tuple(raw[off + i * KEY_BYTES: off + (i + 1) * KEY_BYTES] for i in range(n_blocks))
        meta = raw[off + n_blocks * KEY_BYTES:]
        return cls(transfer_id, keys, n_layers, chunk_bytes, deadline_s, bytes(meta))


def meta_limit(max_meta_bytes: int, n_keys: int) -> int:
    """The most meta a manifest of ``n_keys`` keys may carry."""
    return max_meta_bytes + n_keys * META_BYTES_PER_KEY


def max_manifest_bytes(max_blocks: int, max_meta_bytes: int) -> int:
    return _MANIFEST.size + max_blocks * KEY_BYTES + meta_limit(max_meta_bytes, max_blocks)
