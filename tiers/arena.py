"""The shared-memory arena: one anonymous memfd the daemon creates, pre-faults and hands to
clients by fd passing (SCM_RIGHTS) over its unix socket. There is no path in /dev/shm that
another user could open.
"""

from __future__ import annotations

import array
import ctypes
import gc
import logging
import mmap
import os
import socket
import struct
import threading
import time

import numpy as np

log = logging.getLogger("kvstore.arena")

MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
MADV_HUGEPAGE = 14
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
HUGE_SHMEM = ("advise", "always", "within_size", "force")  # modes where the arena's madvise gets huge pages


def shmem_thp_mode() -> str:
    """The kernel's transparent-huge-page mode for shared memory ("never", "advise", ...)."""
    try:
        text = open(SHMEM_THP).read()
    except OSError:
        return "unknown"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


class PrefaultStopped(Exception):
    """The pre-fault was stopped (a signal asked the process to stop) before every page was in."""


UNMAP_CHUNK_BYTES = 8 << 20      # page tables cleared per mmap-lock hold (Arena.unmap)
PREFAULT_CHUNK_BYTES = 64 << 20  # ~0.1 s of first-touch faults here: how soon a stop is seen


class Arena:
    """A memfd of ``size_bytes`` mapped read-write. ``prefault`` touches every page up front:
    first-touch faults run at ~0.3 GB/s here against 14-20 GB/s into faulted pages. ``stop``
    (anything with ``is_set()``, set by a signal handler) ends a pre-fault early with
    :class:`PrefaultStopped`."""

    def __init__(self, size_bytes: int, name: str = "kvstore-arena", prefault: bool = True,
                 fd: int | None = None, stop=None) -> None:
        self.size_bytes = size_bytes
        self.fd = fd if fd is not None else os.memfd_create(name, os.MFD_CLOEXEC)
        if fd is None:
            os.ftruncate(self.fd, size_bytes)
        self.mmap = mmap.mmap(self.fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = np.frombuffer(self.mmap, dtype=np.uint8)
        self._base = self.buf.ctypes.data  # fixed while the mapping lives (prefault, map, unmap)
        self.prefault_s = 0.0
        if prefault:
            try:
                self.prefault(stop)
            except PrefaultStopped:
                self.close()
                raise

    def prefault(self, stop=None) -> None:
        """Fault every page in, a chunk at a time: between chunks the main thread runs signal
        handlers and ``stop`` is checked, so a SIGTERM during a minutes-long pre-fault of a large
        node is honoured within a chunk's time. madvise runs through ctypes, which releases the
        GIL."""
        t0 = time.perf_counter()
        try:
            # Huge pages cut TLB misses: copies into the arena run ~25% faster (measured 13.4
            # against 9.7-10.9 GB/s), and a copy out of pages not touched for 0.2 s (an
            # engine's load between its requests) about twice as fast on the Intel VM
            # (docs/deploy.md, host tuning). Takes effect where shmem_enabled is one of HUGE_SHMEM.
            self.mmap.madvise(MADV_HUGEPAGE)
        except (OSError, ValueError):
            pass
        base, size, populate = self._base, self.size_bytes, True
        for off in range(0, size, PREFAULT_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                raise PrefaultStopped(f"stopped after pre-faulting {off >> 20} of {size >> 20} MiB")
            n = min(PREFAULT_CHUNK_BYTES, size - off)
            if populate and _libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                populate = False  # a kernel before 5.14: touch the pages instead
            if not populate:
                self.buf[off:off + n:mmap.PAGESIZE] = 0  # one write per page faults it in
        self.prefault_s = time.perf_counter() - t0

    def map_in_background(self, chunk_bytes: int = 8 << 20) -> threading.Event:
        """Fill this mapping's page tables in a background thread (the pages themselves exist:
        the daemon pre-faulted them) and return an Event set when done. A fresh mapping of a
        shared arena faults on every 4 KiB page at first touch: copies into it run at ~3 GB/s
        against ~12 GB/s once mapped; mapping ahead costs ~0.12 s per GiB here, off the
        caller's path. madvise runs through ctypes, which releases the GIL.

        Small chunks: each MADV_POPULATE_READ holds the process's mmap lock for its whole range,
        and any mmap or munmap in the process (a large malloc: every big tensor of an engine's
        forward) waits for it, and every page fault behind that. With 256 MiB chunks a thread
        allocating 8 MiB arrays waited 23-42 ms per allocation while a 1 GiB arena was mapped
        (scratch measurement on this 2-core host; 0.02 ms without it); with 8 MiB chunks
        0.09 ms (max 1.2 ms), the whole mapping taking as long (93-146 ms against 102-122 ms).
        That wait fell on the first load after a daemon restart, in the engine's forward."""
        done = threading.Event()
        base, size = self._base, self.size_bytes

        def run() -> None:
            try:
                for off in range(0, size, chunk_bytes):
                    if self.buf is None or _libc.madvise(ctypes.c_void_p(base + off), ctypes.c_size_t(
                            min(chunk_bytes, size - off)), MADV_POPULATE_READ) != 0:
                        break  # closed, or a kernel without MADV_POPULATE_READ: faults as usual
            finally:
                done.set()

        threading.Thread(target=run, name="kvstore-arena-map", daemon=True).start()
        return done

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A zero-copy uint8 view of ``[offset, offset + nbytes)``."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside arena of {self.size_bytes} bytes")
        return self.buf[offset:offset + nbytes]

    def close(self, background: bool = False) -> None:
        """Close the fd and unmap, now or (``background``) with :meth:`unmap_in_background` (a
        client dropping a dead daemon's arena from an engine's thread). Views still alive keep
        the mapping until they go."""
        self.buf = None  # type: ignore[assignment]
        try:
            os.close(self.fd)
        except OSError:
            pass
        if background:
            self.unmap_in_background(viewed_ok=True)
            return
        try:
            self.mmap.close()
        except BufferError:
            pass  # views still alive; the mapping goes with them

    def unmap_in_background(self, idle=None, idle_s: float = 0.2, within_s: float = 30.0,
                            viewed_ok: bool = False) -> threading.Thread:
        """:meth:`unmap` on a thread of its own at the lowest CPU priority (nice 19): clearing
        the page tables and, for the last mapping of a dead daemon's arena, freeing its pages
        costs ~0.3 s of CPU per GiB here (0.09 s for 0.3 GiB), which an engine's forward on the
        same cores would otherwise share. ``idle``: seconds since the caller last worked (an
        engine's last step); the unmap then waits for ``idle_s`` of quiet, at most ``within_s``:
        even at nice 19 it slowed the copy of a load beside it 3-8x (the first hit after a
        daemon restart, right behind the request that met the new daemon). ``viewed_ok``: views
        still alive are expected (their owner unmaps when it drops them): no collection, no
        warning."""
        def run() -> None:
            deadline = time.monotonic() + within_s
            while idle is not None and time.monotonic() < deadline:
                quiet = idle()
                if quiet >= idle_s:
                    break
                time.sleep(max(0.01, idle_s - quiet))
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
            except OSError:
                pass
            self.unmap(viewed_ok)

        t = threading.Thread(target=run, name="kvstore-unmap", daemon=True)
        t.start()
        return t

    def unmap(self, viewed_ok: bool = False) -> None:
        """After :meth:`close` left the mapping to live views: unmap it now, collecting the
        reference cycles that may hold the last view first (not when ``viewed_ok``). Blocking:
        the munmap frees the pages and takes as long as their count, without the GIL, so call it
        off a thread that must not wait. Still viewed after that: it stays mapped until the view
        goes."""
        if self.buf is not None or self.mmap.closed:
            return  # open, or already unmapped
        # The page tables first, a chunk at a time (MADV_DONTNEED on a shared mapping drops this
        # process's page-table entries; the memfd keeps the pages, a view left would fault them
        # back in): one munmap of a whole mapped arena holds the process's mmap lock while it
        # clears every entry (~20 ms for 0.3 GiB of 4 KiB pages here), and the engine's large
        # allocations and page faults wait behind it.
        for off in range(0, self.size_bytes, UNMAP_CHUNK_BYTES):
            _libc.madvise(ctypes.c_void_p(self._base + off), ctypes.c_size_t(min(UNMAP_CHUNK_BYTES, self.size_bytes - off)),
                          MADV_DONTNEED)
        try:
            self.mmap.close()
        except BufferError:
            if viewed_ok:
                return
            gc.collect()
            try:
                self.mmap.close()
            except BufferError:
                log.warning("an arena closed by its client is still viewed; it stays mapped until that view is gone")


def slot_runs(offsets, stride: int):
    """``(first, end, offset)`` of each run of blocks whose slots sit next to each other in the
    arena (``offsets[i]`` is None for a block to skip), so a run moves in one copy."""
    j, n = 0, len(offsets)
    while j < n:
        if offsets[j] is None:
            j += 1
            continue
        k = j + 1
        while k < n and offsets[k] is not None and offsets[k] == offsets[k - 1] + stride:
            k += 1
        yield j, k, offsets[j]
        j = k


# --- fd passing -------------------------------------------------------------------------------

_HDR = struct.Struct("<Q")


def send_fd(sock: socket.socket, fd: int, size_bytes: int) -> None:
    sock.sendmsg([_HDR.pack(size_bytes)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


# The size a refusal carries instead of a real one; then a byte (1: retry, the daemon is busy),
# the length of the reason (2 bytes, little-endian) and the reason in UTF-8.
HANDOUT_REFUSED = (1 << 64) - 1
_REFUSAL = struct.Struct("<BH")


class HandoutRefused(ConnectionError):
    """The daemon said no to a handout, and why. ``retryable``: it was busy (a connection cap),
    so the same request may succeed a moment later; else it will not (unknown session, no pool)."""

    def __init__(self, reason: str, retryable: bool) -> None:
        super().__init__(reason)
        self.reason, self.retryable = reason, retryable


def send_refusal(sock: socket.socket, reason: str, retryable: bool) -> None:
    """Tell a handout client why it gets nothing, without ever blocking the daemon (the reply is
    a few hundred bytes into a fresh socket's empty buffer; if even that fails, it just closes)."""
    body = reason.encode()[:1024]
    try:
        sock.send(_HDR.pack(HANDOUT_REFUSED) + _REFUSAL.pack(int(retryable), len(body)) + body, socket.MSG_DONTWAIT)
    except OSError:
        pass


def recv_header(sock: socket.socket) -> tuple[int | None, int]:
    """Receive ``(fd or None, size)``: an 8-byte little-endian size, with or without an fd
    passed alongside. Raises :class:`HandoutRefused` when the daemon said no (and why), and
    ConnectionError when it closed without a word (a daemon older than refusals)."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = sock.recvmsg(_HDR.size, socket.CMSG_LEN(fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if len(msg) != _HDR.size:
        raise ConnectionError("daemon closed the arena socket without an answer (unknown or expired session)")
    size = _HDR.unpack(msg)[0]
    if size == HANDOUT_REFUSED:
        head = _recv_exactly(sock, _REFUSAL.size)
        retry, n = _REFUSAL.unpack(head)
        raise HandoutRefused(_recv_exactly(sock, n).decode(errors="replace"), bool(retry))
    return (fds[0] if fds else None), size


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        piece = sock.recv(n - len(got))
        if not piece:
            raise ConnectionError("daemon closed the arena socket in the middle of its answer")
        got += piece
    return got


def recv_fd(sock: socket.socket) -> tuple[int, int]:
    """Receive ``(fd, size_bytes)`` sent by :func:`send_fd`; raises ConnectionError if refused."""
    fd, size = recv_header(sock)
    if fd is None:
        raise ConnectionError("daemon sent no arena descriptor (unknown or expired session)")
    return fd, size
