"""HBM tier: fixed-size slots per namespace in one device pool, filled and drained by DMA.

The pool is one ``torch.empty(capacity, uint8, device=cuda)`` cut into slots by the same
:class:`ExtentAllocator` the DRAM tier uses. Promotion (host -> HBM, ``write``/``promote``)
and demotion (HBM -> host, ``read``/``demote``) run on dedicated CUDA streams, never the
default stream; every op records an event, and an op on a slot that another stream still
touches first waits on that stream's event (read-after-write, write-after-read and
write-after-write on one slot keep program order across streams). Host memory handed in
should be the shared arena registered with :meth:`register_host`, so the copies are DMA.

With no GPU (``device="auto"`` on a machine without CUDA, or ``device="emulated"``) the same
class runs on an emulated device: the pool is a separate memory arena, each stream is a copy
thread, each event a ``threading.Event`` (:mod:`kvstore.tiers.hbm_device`). Allocation,
hazard tracking and completion are the same code on both, so CI exercises them.
``stats().emulated`` and ``stats().extra["reason"]`` say which one runs; the daemon reports
``hbm_emulated`` from :attr:`HbmTier.emulated`, so no figure is mistaken for a GPU figure.

Workers reach the pool directly through :meth:`ipc_handle` (CUDA IPC through torch's
``UntypedStorage._share_cuda_()``, the mechanism ``torch.multiprocessing`` uses; emulated: the
pool's memfd, to be passed by SCM_RIGHTS like the DRAM arena); a worker maps it with
:func:`open_pool`.

Keeps :class:`kvstore.tiers.base.DevicePoolTier` (what the daemon drives: allocate, free,
promote, ipc_handle); ``demote``, ``copy_async`` and the per-slot ``write``/``read`` (and their
async forms) serve workers' tools, benchmarks and tests. Not thread-safe: allocate / free /
submit from one thread (the daemon's core lock). Copies and completions run on the tier's own
streams and threads.
"""

from __future__ import annotations

import itertools
import logging
import os
import warnings
from dataclasses import dataclass
from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.tiers.arena import Arena
from kvstore.tiers.base import ExtentAllocator, TierError, TierKind, TierStats, CopyHandle
from kvstore.tiers.hbm_device import DeviceKind, HostPin, Lane, choose_device, make_stream

log = logging.getLogger("kvstore.hbm")

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class HbmTierConfig:
    """``capacity_bytes``: pool size (bytes). ``extent_bytes``: allocation unit a namespace
    takes whole (0: min(capacity, 64 MiB)). ``device``: "auto" | "emulated" | CUDA index.
    ``streams``: copy streams, at least 2; the first half promote (host -> HBM), the rest
    demote (HBM -> host), round-robin within each. ``prefault``: fault the emulated pool in."""

    capacity_bytes: int
    extent_bytes: int = 0
    device: str | int = "auto"
    streams: int = 2
    prefault: bool = True

    @classmethod
    def from_config(cls, cfg) -> "HbmTierConfig":
        """From the daemon's :class:`kvstore.config.Config` (``hbm.*``, DRAM's extent size)."""
        return cls(cfg.hbm.capacity_bytes, min(cfg.dram.extent_bytes, cfg.hbm.capacity_bytes),
                   cfg.hbm.device, getattr(cfg.hbm, "streams", 2), cfg.dram.prefault)


def _host_bytes(buf) -> np.ndarray:
    """A flat uint8 numpy view of a host buffer (numpy array, CPU tensor, memoryview...)."""
    if hasattr(buf, "numpy") and hasattr(buf, "is_cuda"):  # a CPU torch tensor, without importing torch
        buf = buf.detach().numpy()
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8) if buf.flags.c_contiguous else np.frombuffer(buf, np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def _host_span(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """One flat view over ``a`` then ``b`` where ``b`` starts right where ``a`` ends inside the
    same buffer (neighbouring slots of the arena), else None."""
    if a.base is None or a.base is not b.base or a.ctypes.data + a.nbytes != b.ctypes.data:
        return None
    try:
        whole = np.frombuffer(a.base, np.uint8)
    except (TypeError, ValueError):  # not a flat buffer
        return None
    off = a.ctypes.data - whole.ctypes.data
    if not 0 <= off <= whole.nbytes - a.nbytes - b.nbytes or whole.flags.writeable < a.flags.writeable:
        return None
    return whole[off:off + a.nbytes + b.nbytes]


def _coalesce(pieces: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    """(slot offset, host bytes) pairs with neighbours merged where they are contiguous both in
    the pool and in host memory: a batch of a block chain's slots becomes a few large copies
    instead of one per slot (each copy costs a call and a DMA setup: 0.79-0.81 of one
    cudaMemcpy per 4 MiB slot on an H200, against 1.0 for one copy)."""
    out: list[tuple[int, np.ndarray]] = []
    for off, h in pieces:
        if out and out[-1][0] + out[-1][1].nbytes == off:
            merged = _host_span(out[-1][1], h)
            if merged is not None:
                out[-1] = (out[-1][0], merged)
                continue
        out.append((off, h))
    return out


class _CudaPool:
    """The device pool and its copy primitive on CUDA."""

    def __init__(self, index: int, capacity_bytes: int) -> None:
        import torch

        self.torch = torch
        with torch.cuda.device(index):
            self.mem = torch.empty(capacity_bytes, dtype=torch.uint8, device=f"cuda:{index}")
        from kvstore.tiers.kv_copy import triton_missing  # torch only where a GPU pool is made

        why = triton_missing(self.mem.device)
        self.kernels = not why
        if why:
            log.warning("kvstore: HBM device-to-device copies without Triton (%s): one torch._foreach_copy_ "
                        "per transfer", why)

    def slice(self, off: int, n: int):
        return self.mem[off:off + n]

    def copy_spans(self, spans: list[tuple[int, int, int]]) -> None:
        """Every ``(dst, src, nbytes)`` inside the pool in one launch (Triton), else in one
        ``torch._foreach_copy_`` call: never one call per slot (0.02-0.03 of one device copy
        for 4 MiB slots on an H200: the Python call and its event cost ~60 us, the copy ~2 us)."""
        if self.kernels:
            from kvstore.tiers.kv_copy import copy_spans

            copy_spans(self.mem, spans)
        else:
            self.torch._foreach_copy_([self.slice(d, n) for d, _, n in spans], [self.slice(s, n) for _, s, n in spans],
                                      non_blocking=True)

    def host(self, arr: np.ndarray):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only sources are only read
            return self.torch.from_numpy(arr)

    @staticmethod
    def copy(dst, src) -> None:
        dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        self.mem = None


class _EmuPool:
    """The emulated device: a separate memory arena standing in for HBM."""

    def __init__(self, capacity_bytes: int, prefault: bool) -> None:
        self.arena = Arena(capacity_bytes, name="kvstore-hbm-emulated", prefault=prefault)

    def slice(self, off: int, n: int) -> np.ndarray:
        return self.arena.view(off, n)

    @staticmethod
    def host(arr: np.ndarray) -> np.ndarray:
        return arr

    @staticmethod
    def copy(dst, src) -> None:
        np.copyto(dst, src)

    def copy_spans(self, spans: list[tuple[int, int, int]]) -> None:
        buf = self.arena.buf
        for d, s, n in spans:
            np.copyto(buf[d:d + n], buf[s:s + n])

    def close(self) -> None:
        self.arena.close()


class _SlotOrder:
    """Per-slot hazards across lanes: the last write's event and the reads since it."""

    def __init__(self) -> None:
        self._write: dict[int, tuple[Lane, object]] = {}
        self._reads: dict[int, list[tuple[Lane, object]]] = {}

    def deps(self, lane: Lane, slot: int, write: bool) -> list[tuple[object, bool]]:
        """Events an op on ``slot`` must wait for, each with whether its failure fails the op:
        a read inherits the failure of the write it reads (the slot holds no good data), a
        write only needs order (it replaces whatever is there)."""
        out = []
        w = self._write.get(slot)
        if w is not None:
            ln, ev = w
            if write:
                if ln is not lane and not ev.query():
                    out.append((ev, False))
            # A read waits on a failed write even when it fired, and on a same-stream write
            # when emulated (the stream orders it, but only the wait carries the failure).
            elif ev.error is not None or (not ev.query() and (ln is not lane or lane.stream.emulated)):
                out.append((ev, True))
        if write:
            out += [(ev, False) for ln, ev in self._reads.get(slot, ()) if ln is not lane and not ev.query()]
        return out

    def note(self, lane: Lane, slot: int, ev, write: bool) -> None:
        if write:
            self._write[slot] = (lane, ev)
            self._reads.pop(slot, None)
        else:
            reads = self._reads.setdefault(slot, [])
            reads[:] = [r for r in reads if not r[1].query()]
            reads.append((lane, ev))

    def pending(self, slot: int) -> list:
        evs = [self._write[slot]] if slot in self._write else []
        return [ev for _, ev in evs + self._reads.get(slot, []) if not ev.query()]

    def forget(self, slot: int) -> None:
        self._write.pop(slot, None)
        self._reads.pop(slot, None)


class HbmTier:
    kind = TierKind.HBM

    def __init__(self, config: HbmTierConfig) -> None:
        if config.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {config.capacity_bytes}")
        if config.streams < 2:
            raise ValueError(f"streams: need at least 2 (one to promote, one to demote), got {config.streams}")
        self.config = config
        self.device = choose_device(config.device)
        extent = config.extent_bytes or min(config.capacity_bytes, 64 * MiB)
        self.alloc = ExtentAllocator(config.capacity_bytes, extent)
        if self.device.kind is DeviceKind.CUDA:
            try:
                self.pool = _CudaPool(self.device.index, config.capacity_bytes)
            except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
                raise TierError(f"capacity_bytes: cannot allocate {config.capacity_bytes} bytes on "
                                f"{self.device.name}: {e}") from None
        else:
            self.pool = _EmuPool(config.capacity_bytes, config.prefault)
        n_up = (config.streams + 1) // 2
        lanes = [Lane(make_stream(self.device, f"kvstore-hbm-{i}"), f"kvstore-hbm-{i}") for i in range(config.streams)]
        self.promote_lanes, self.demote_lanes = lanes[:n_up], lanes[n_up:]
        self._next_up = itertools.cycle(self.promote_lanes)
        self._next_down = itertools.cycle(self.demote_lanes)
        self._order = _SlotOrder()
        self._live: set[int] = set()
        self._pins: list[HostPin] = []
        self.bytes_promoted = 0
        self.bytes_demoted = 0
        self._closed = False

    # --- identity ---------------------------------------------------------------------------
    @property
    def emulated(self) -> bool:
        """True when no GPU backs the pool; the daemon reports it as ``hbm_emulated``."""
        return self.device.emulated

    @property
    def reason(self) -> str:
        """Why the tier is emulated ("" on a GPU)."""
        return self.device.reason

    @property
    def capacity_bytes(self) -> int:
        return self.alloc.usable_bytes

    # --- allocation (same rules as the DRAM tier) -------------------------------------------
    def slot_stride(self, slot_bytes: int) -> int:
        return self.alloc.slot_stride(slot_bytes)

    def fits(self, slot_bytes: int) -> bool:
        return self.alloc.fits(slot_bytes)

    def allocate(self, ns_id: bytes, slot_bytes: int) -> int | None:
        off = self.alloc.allocate(ns_id, slot_bytes)
        if off is not None:
            self._live.add(off)
        return off

    def free(self, ns_id: bytes, slot: int) -> None:
        """Give ``slot`` back. Copies still in flight on it are waited for first (the slot's
        memory is handed to the next ``allocate``)."""
        owner = self.alloc.owner(slot)
        if slot not in self._live or owner is None or owner[0] != ns_id:
            raise ValueError(f"slot at {slot} is not allocated to this namespace")
        for ev in self._order.pending(slot):
            try:
                ev.synchronize()
            except BaseException:  # noqa: BLE001 - its CopyHandle reports it; the slot is gone
                pass
        self._order.forget(slot)
        self.alloc.free(ns_id, owner[1], slot)
        self._live.discard(slot)

    def _slot_bytes(self, slot: int, nbytes: int) -> int:
        if self._closed:
            raise TierError("HBM tier is closed")
        owner = self.alloc.owner(slot)
        if slot not in self._live or owner is None:
            raise ValueError(f"slot at {slot} is not allocated")
        if nbytes > owner[1]:
            raise ValueError(f"{nbytes} bytes do not fit a {owner[1]}-byte slot (would overwrite its neighbour)")
        return owner[1]

    # --- pinned host memory -------------------------------------------------------------------
    def register_host(self, arena: Arena) -> bool:
        """Page-lock the shared DRAM arena for DMA (``cudaHostRegister``); returns whether
        memory was pinned (False when emulated). Undone by :meth:`close`."""
        pin = HostPin(self.device, arena.buf.ctypes.data, arena.size_bytes)
        self._pins.append(pin)
        return pin.pinned

    # --- data -----------------------------------------------------------------------------------
    def _submit(self, lane: Lane, ops: Sequence[tuple[int, bool]], copies: list, keep) -> CopyHandle:
        """Queue ``copies`` (dst, src) on ``lane`` after the hazards of ``ops`` (slot, writes)."""
        copy = self.pool.copy

        def run() -> None:
            for dst, src in copies:
                copy(dst, src)

        return self._queue(lane, ops, run, sum(int(src.nbytes) for _, src in copies), keep)

    def _queue(self, lane: Lane, ops: Sequence[tuple[int, bool]], run, nbytes: int, keep) -> CopyHandle:
        deps = [d for slot, write in ops for d in self._order.deps(lane, slot, write)]
        t = CopyHandle(nbytes)
        ev = lane.run(run, deps, t, keep)
        for slot, write in ops:
            self._order.note(lane, slot, ev, write)
        return t

    def promote(self, pairs: Iterable[tuple[int, object]]) -> CopyHandle:
        """Host -> HBM for each ``(slot, src)`` as one transfer (one event) on a promotion
        stream. ``src`` must stay unchanged until the transfer is done."""
        ops, pieces, keep = [], [], []
        for slot, src in pairs:
            h = _host_bytes(src)
            self._slot_bytes(slot, h.nbytes)
            ops.append((slot, True))
            pieces.append((slot, h))
            keep.append(src)
        copies = [(self.pool.slice(off, h.nbytes), self.pool.host(h)) for off, h in _coalesce(pieces)]
        t = self._submit(next(self._next_up), ops, copies, keep)
        self.bytes_promoted += t.nbytes
        return t

    def demote(self, pairs: Iterable[tuple[int, object]]) -> CopyHandle:
        """HBM -> host for each ``(slot, dst)`` as one transfer on a demotion stream; the
        first ``len(dst)`` bytes of the slot are copied. ``dst`` is valid once it is done."""
        ops, pieces, keep = [], [], []
        for slot, dst in pairs:
            h = _host_bytes(dst)
            if not h.flags.writeable:
                raise ValueError("dst: buffer is read-only")
            self._slot_bytes(slot, h.nbytes)
            ops.append((slot, False))
            pieces.append((slot, h))
            keep.append(dst)
        copies = [(self.pool.host(h), self.pool.slice(off, h.nbytes)) for off, h in _coalesce(pieces)]
        t = self._submit(next(self._next_down), ops, copies, keep)
        self.bytes_demoted += t.nbytes
        return t

    def copy_async(self, dst_slot: int, src_slot: int, nbytes: int) -> CopyHandle:
        """Device-to-device copy of ``nbytes`` between two slots of the pool."""
        return self.copy_many([(dst_slot, src_slot, nbytes)])

    def copy_many(self, pairs: Iterable[tuple[int, int, int]]) -> CopyHandle:
        """Device-to-device copies ``(dst_slot, src_slot, nbytes)`` inside the pool as one
        transfer: one launch and one event, neighbouring spans merged. Destinations must be
        distinct slots, none of them a source of another pair."""
        ops, spans, total = [], [], 0
        for dst, src, n in pairs:
            self._slot_bytes(dst, n)
            self._slot_bytes(src, n)
            total += n
            if dst == src:
                continue
            ops += [(src, False), (dst, True)]
            if spans and spans[-1][0] + spans[-1][2] == dst and spans[-1][1] + spans[-1][2] == src:
                spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + n)
            else:
                spans.append((dst, src, n))
        if not spans:
            return CopyHandle.completed(total)
        return self._queue(next(self._next_up), ops, lambda: self.pool.copy_spans(spans), total, None)

    def write_async(self, slot: int, src) -> CopyHandle:
        return self.promote([(slot, src)])

    def read_async(self, slot: int, dst) -> CopyHandle:
        return self.demote([(slot, dst)])

    def write(self, slot: int, src) -> None:
        self.write_async(slot, src).result()

    def read(self, slot: int, dst) -> None:
        self.read_async(slot, dst).result()

    def synchronize(self) -> None:
        """Wait until every queued copy has run."""
        for lane in self.promote_lanes + self.demote_lanes:
            lane.stream.synchronize()

    # --- sharing with workers -------------------------------------------------------------------
    def ipc_handle(self) -> dict:
        """What a worker needs to map the pool (:func:`open_pool`). CUDA: the fields
        of torch's ``UntypedStorage._share_cuda_()`` (bytes and ints; send them over the
        daemon's socket). Emulated: the pool's memfd, to be passed by SCM_RIGHTS."""
        base = {"capacity_bytes": self.config.capacity_bytes}
        if self.device.kind is DeviceKind.EMULATED:
            return {**base, "kind": "emulated", "fd": self.pool.arena.fd}
        (dev, handle, size, offset, ref_handle, ref_offset, ev_handle, ev_sync) = \
            self.pool.mem.untyped_storage()._share_cuda_()
        return {**base, "kind": "cuda", "device": dev, "handle": handle, "storage_bytes": size,
                "storage_offset": offset, "ref_counter_handle": ref_handle, "ref_counter_offset": ref_offset,
                "event_handle": ev_handle, "event_sync_required": ev_sync}

    # --- stats and lifecycle ----------------------------------------------------------------------
    def stats(self) -> TierStats:
        extra = {"backend": self.device.kind.value, "device": self.device.name,
                 "streams": len(self.promote_lanes) + len(self.demote_lanes),
                 "host_pinned": any(p.pinned for p in self._pins),
                 "bytes_promoted": self.bytes_promoted, "bytes_demoted": self.bytes_demoted}
        if self.emulated:
            extra["reason"] = self.reason
        return TierStats(TierKind.HBM, self.capacity_bytes, self.alloc.used_bytes, self.alloc.used_slots,
                         emulated=self.emulated, extra=extra)

    def close(self) -> None:
        """Finish queued copies, stop the streams, unpin host memory, release the pool."""
        if self._closed:
            return
        self._closed = True
        for lane in self.promote_lanes + self.demote_lanes:
            lane.close()
        for pin in self._pins:
            pin.close()
        self._pins.clear()
        self.pool.close()


class PoolMapping:
    """A worker's mapping of the daemon's HBM pool (``HbmTier.ipc_handle()``): ``mem`` is a
    uint8 tensor of ``capacity_bytes`` (CUDA, or CPU over the emulated pool's memfd)."""

    def __init__(self, handle: dict) -> None:
        self.kind = handle["kind"]
        self._arena = None
        if self.kind == "emulated":
            import torch

            self._arena = Arena(handle["capacity_bytes"], fd=os.dup(handle["fd"]), prefault=False)
            self.mem = torch.from_numpy(self._arena.buf)
        elif self.kind == "cuda":
            import torch
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            self.mem = rebuild_cuda_tensor(
                torch.Tensor, (handle["capacity_bytes"],), (1,), 0, torch.UntypedStorage, torch.uint8,
                handle["device"], handle["handle"], handle["storage_bytes"], handle["storage_offset"], False,
                handle["ref_counter_handle"], handle["ref_counter_offset"], handle["event_handle"],
                handle["event_sync_required"])
        else:
            raise ValueError(f"handle: unknown pool kind {self.kind!r}")

    def close(self) -> None:
        self.mem = None
        if self._arena is not None:
            self._arena.close()


def open_pool(handle: dict) -> PoolMapping:
    """Map the daemon's HBM pool in this process from :meth:`HbmTier.ipc_handle`'s answer."""
    return PoolMapping(handle)
