"""The NVMe tier's data files: preallocated files forming one flat offset space, O_DIRECT reads
and writes between a file and a caller's buffer (through a bounce buffer where alignment needs
it), and per-layer-chunk checksums.

Everything here raises plain ``OSError``; the tier turns those into tier errors. ``os.preadv``
/ ``os.pwritev`` and xxh3 release the GIL, so several threads keep several I/Os in flight.
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import stat
from array import array
from typing import Iterable

import numpy as np
import xxhash

ALIGN = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses (>= any logical block size)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class IoMode(enum.Enum):
    """How the data files are accessed. AUTO probes O_DIRECT and falls back to BUFFERED."""

    AUTO = "auto"
    DIRECT = "direct"      # O_DIRECT: straight between the caller's buffer and the device
    BUFFERED = "buffered"  # through the page cache (fdatasync before each commit in SyncMode.DURABLE)


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def as_u8(buf, writable: bool, what: str) -> np.ndarray:
    """A zero-copy flat uint8 view of a C-contiguous buffer (memoryview, numpy, bytes...)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{what}: buffer must be C-contiguous")
        a = buf.reshape(-1).view(np.uint8)
    else:
        try:
            a = np.frombuffer(buf, dtype=np.uint8)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: not a contiguous buffer ({e})") from None
    if writable and not a.flags.writeable:
        raise ValueError(f"{what}: buffer is read-only")
    return a


def chunk_sums(a: np.ndarray, nbytes: int, chunk_bytes: int) -> array:
    """xxh3_64 of every ``chunk_bytes`` piece of ``a[:nbytes]`` (the last one may be shorter);
    ``chunk_bytes`` 0 means one checksum over the whole block."""
    step = chunk_bytes or nbytes
    m, h = memoryview(a), xxhash.xxh3_64_intdigest  # memoryview slices are cheaper than numpy's
    return array("Q", [h(m[i:min(i + step, nbytes)]) for i in range(0, nbytes, step)])


def aligned_buffer(nbytes: int) -> np.ndarray:
    """Page-aligned anonymous memory (mmap), as a uint8 array."""
    return np.frombuffer(mmap.mmap(-1, round_up(nbytes)), dtype=np.uint8)


def _after(bufs: list, done: int) -> list:
    """What is left of ``bufs`` once their first ``done`` bytes are through (short I/O)."""
    rest = []
    for b in bufs:
        if done >= b.nbytes:
            done -= b.nbytes
        else:
            rest.append(b[done:])
            done = 0
    return rest


def _pwritev_all(fd: int, bufs: list, offset: int) -> None:
    total = sum(b.nbytes for b in bufs)
    done = os.pwritev(fd, bufs, offset)
    while done < total:  # short write: continue buffer by buffer from where it stopped
        n = os.pwritev(fd, _after(bufs, done)[:1], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote 0 bytes")
        done += n


def _preadv_all(fd: int, bufs: list, offset: int) -> int:
    """Fill ``bufs``; returns bytes read (< total only at end of file)."""
    total = sum(b.nbytes for b in bufs)
    done = os.preadv(fd, bufs, offset)
    while 0 < done < total:
        n = os.preadv(fd, _after(bufs, done)[:1], offset + done)
        if n == 0:
            break
        done += n
    return done


# Block data, the index and the namespaces file (tenant salts) are the daemon's alone.
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700


def private_dir(path: str) -> None:
    """Make ``path`` a directory only its owner can use, whatever the umask: missing directories
    (parents included) are created 0700, and an existing ``path`` is taken to 0700."""
    missing, p = [], os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d, PRIVATE_DIR)  # the umask can only take bits away
    private_mode(path, PRIVATE_DIR)


def private_mode(path: str, mode: int) -> None:
    """Take an existing file or directory to ``mode`` (left alone when it has it already)."""
    if stat.S_IMODE(os.stat(path).st_mode) != mode:
        os.chmod(path, mode)


class DataFiles:
    """``n`` preallocated files of ``file_bytes`` (the last may be shorter) forming one flat
    offset space of ``capacity_bytes``. A slot never straddles two files (extents divide
    ``file_bytes``). Thread-safe: positional I/O only, no shared file position."""

    def __init__(self, directory: str, capacity_bytes: int, file_bytes: int, mode: IoMode,
                 preallocate: bool = True) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.file_bytes = file_bytes
        self.fds: list[int] = []
        self.sizes = [min(file_bytes, capacity_bytes - i) for i in range(0, capacity_bytes, file_bytes)]
        try:
            for i, size in enumerate(self.sizes):
                self.fds.append(self._open(os.path.join(directory, f"data-{i:05d}.kvd"), size, preallocate))
            self.mode = self._choose_mode(mode)
        except BaseException:
            self.close()
            raise
        # Diagnostics (updated without a lock, so approximate under concurrency):
        self.direct_ios = 0   # block I/Os done straight from / into the caller's buffer
        self.bounced_ios = 0  # block I/Os that went (partly) through an aligned bounce buffer
        self.vectored_ios = 0  # syscalls that moved several adjacent blocks at once

    @staticmethod
    def _open(path: str, size: int, preallocate: bool) -> int:
        # Never blocking, never through a link: a FIFO or a link in a data file's place is an error.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, PRIVATE_FILE)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            os.fchmod(fd, PRIVATE_FILE)  # a file an older daemon made keeps its mode through O_CREAT
            old = os.fstat(fd).st_size
            if preallocate:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.ftruncate(fd, old)  # don't leave a half-allocated file eating the disk
                    raise
            elif old < size:
                os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _choose_mode(self, mode: IoMode) -> IoMode:
        if mode is IoMode.BUFFERED:
            return mode
        # Reopen every file with O_DIRECT and probe one aligned read; a filesystem that refuses
        # O_DIRECT fails here with EINVAL (at open or at the first I/O).
        direct = []
        try:
            for i in range(len(self.fds)):
                direct.append(os.open(os.path.join(self.directory, f"data-{i:05d}.kvd"),
                                      os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW))
            probe = aligned_buffer(ALIGN)
            os.preadv(direct[0], [probe], 0)
        except OSError as e:
            for fd in direct:
                os.close(fd)
            if mode is IoMode.DIRECT or e.errno != errno.EINVAL:
                raise
            return IoMode.BUFFERED
        for fd in self.fds:
            os.close(fd)
        self.fds = direct
        return IoMode.DIRECT

    def _locate(self, offset: int) -> tuple[int, int]:
        return self.fds[offset // self.file_bytes], offset % self.file_bytes

    def file_of(self, offset: int) -> int:
        return offset // self.file_bytes

    def write(self, offset: int, src: np.ndarray, bounce: np.ndarray) -> None:
        """Write ``src`` at ``offset``; the tail up to the next ALIGN boundary is zero padding."""
        fd, off = self._locate(offset)
        n = src.nbytes
        head = self._direct_prefix(src, n)
        if head == n:
            _pwritev_all(fd, [src], off)
            self.direct_ios += 1
            return
        self.bounced_ios += 1
        # Stage what O_DIRECT cannot take as is (an unaligned address, or the unaligned tail)
        # through the bounce buffer; the first piece rides in the same pwritev as the head.
        bufs, pos, start = ([src[:head]] if head else []), head, off
        while pos < n:
            piece = min(n - pos, bounce.nbytes)
            padded = round_up(piece)
            bounce[:piece] = src[pos:pos + piece]
            bounce[piece:padded] = 0
            bufs.append(bounce[:padded])
            _pwritev_all(fd, bufs, start)
            pos += piece
            bufs, start = [], off + pos

    def read(self, offset: int, dst: np.ndarray, nbytes: int, bounce: np.ndarray) -> None:
        """Fill ``dst[:nbytes]`` from ``offset``. Past end of file the rest is zero-filled (the
        checksum then fails), so a truncated file reads as corrupt, never as valid."""
        fd, off = self._locate(offset)
        out = dst[:nbytes]
        head = self._direct_prefix(out, nbytes)
        if head == nbytes:
            got = _preadv_all(fd, [out], off)
            out[got:] = 0
            self.direct_ios += 1
            return
        self.bounced_ios += 1
        bufs, pos, start = ([out[:head]] if head else []), head, off
        while pos < nbytes:
            piece = min(nbytes - pos, bounce.nbytes)
            padded = round_up(piece)
            bounce[:padded] = 0
            with_head = bool(bufs)
            bufs.append(bounce[:padded])
            got = _preadv_all(fd, bufs, start)
            if with_head and got < head:
                out[got:head] = 0
            out[pos:pos + piece] = bounce[:piece]
            pos += piece
            bufs, start = [], off + pos

    def direct_ok(self, buf: np.ndarray) -> bool:
        """True if ``buf`` can be one piece of a vectored I/O: whole ALIGN units at an aligned
        address (any buffer in BUFFERED mode, as long as it fills whole ALIGN units)."""
        return buf.nbytes % ALIGN == 0 and (self.mode is IoMode.BUFFERED or buf.ctypes.data % ALIGN == 0)

    def write_vec(self, offset: int, bufs: list[np.ndarray]) -> None:
        """One vectored write of adjacent slots starting at ``offset``; every buffer passes
        :meth:`direct_ok` and the run stays inside one file."""
        fd, off = self._locate(offset)
        _pwritev_all(fd, bufs, off)
        self.direct_ios += len(bufs)
        self.vectored_ios += 1

    def read_vec(self, offset: int, bufs: list[np.ndarray]) -> None:
        """One vectored read into adjacent slots' buffers (see :meth:`write_vec`); past end of
        file the buffers are zero-filled (the checksums then fail)."""
        fd, off = self._locate(offset)
        got = _preadv_all(fd, bufs, off)
        for b in bufs:
            if got < b.nbytes:
                b[max(got, 0):] = 0
            got -= b.nbytes
        self.direct_ios += len(bufs)
        self.vectored_ios += 1

    def _direct_prefix(self, buf: np.ndarray, n: int) -> int:
        """How many leading bytes of ``buf`` can go to the file without staging."""
        if self.mode is IoMode.BUFFERED:
            return n
        if buf.ctypes.data % ALIGN:
            return 0
        return n - n % ALIGN

    def sync(self, files: Iterable[int] | None = None) -> None:
        """fdatasync the given files (indices), or all. Needed even with O_DIRECT: it commits
        the extent conversion of preallocated space and flushes the device's write cache."""
        for i in sorted(set(range(len(self.fds)) if files is None else files)):
            os.fdatasync(self.fds[i])

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
