"""Read a pinned DRAM hit's pages ahead of the client's copy.

A Lookup that pins a hit in DRAM (``pin``: vLLM's scheduler asks for it) is answered some tens
of milliseconds before the engine's worker copies those slots: the engine schedules the step and
prepares its inputs in between. On a VM whose host reclaims or tracks idle guest memory, a 4 KiB
page nobody touched for a fraction of a second costs 5-50 us at its next touch (this 2-core VM:
a 12.6 MB copy out of memory idle for 0.5 s ran at 0.04-2 GB/s, against 7-11 GB/s back to back;
huge pages on both sides avoid most of it, docs/deploy.md). A DRAM hit's copy pays that on every
page of its source and of its destination. Meanwhile the daemon reads one byte of each page of
the pinned slots on a thread of its own, so the copy finds its source pages present.

Where idle memory is as fast as any this costs well under a millisecond per hit on a thread
that is otherwise idle. A job still queued when its client has surely copied (``late_s``) is
dropped, as is one past the backlog: reading those pages would help nobody.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

log = logging.getLogger("kvstore.daemon.warmer")
BACKLOG_BYTES = 1 << 30  # queued and not yet read; past it a new job is dropped
LATE_S = 0.5  # a job queued this long is dropped: its client's copy is over
NICE = 19  # the lowest CPU priority


class PageWarmer:
    """One thread reading one byte per page of the ranges :meth:`warm` queues. ``buf`` gives the
    arena's bytes (a uint8 array, or None once the arena is closed). ``counted(outcome, nbytes)``
    is told of every job: ``read``, ``full`` (over the backlog) or ``late`` (dropped unread)."""

    def __init__(self, buf: Callable[[], np.ndarray | None], counted: Callable[[str, int], None] | None = None,
                 page_bytes: int = mmap.PAGESIZE, backlog_bytes: int = BACKLOG_BYTES, late_s: float = LATE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._buf = buf
        self._counted = counted or (lambda outcome, nbytes: None)
        self.page_bytes = page_bytes
        self.backlog_bytes = backlog_bytes
        self.late_s = late_s
        self._clock = clock
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # bytes
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstore-warmer", daemon=True)
        self._thread.start()

    def warm(self, offsets: Sequence[int], nbytes: int) -> bool:
        """Queue ``[offset, offset + nbytes)`` of each offset; False where the backlog is full
        (nothing queued). Never waits: called under the core lock, in the Lookup."""
        total = len(offsets) * nbytes
        if not total:
            return False
        with self._lock:
            if self._queued + total > self.backlog_bytes:
                full = True
            else:
                full, self._queued = False, self._queued + total
        if full:
            self._counted("full", total)
            return False
        self._jobs.put((self._clock(), np.asarray(offsets, dtype=np.intp), nbytes))
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def pages(self, offsets: np.ndarray, nbytes: int) -> np.ndarray:
        """The byte offsets read for these ranges: each range's first byte, every page on from
        it, and its last byte (a range need not start on a page)."""
        steps = np.arange(0, nbytes, self.page_bytes, dtype=np.intp)
        return np.concatenate(((offsets[:, None] + steps).ravel(), offsets + (nbytes - 1)))

    def _run(self) -> None:
        try:  # this thread only (Linux): it reads on a core that is idle, never beside work
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except OSError:
            pass
        while (job := self._jobs.get()) is not None:
            queued_at, offsets, nbytes = job
            total = len(offsets) * nbytes
            try:
                buf = self._buf()
                if buf is None or self._clock() - queued_at > self.late_s:
                    self._counted("late", total)
                    continue
                buf.take(self.pages(offsets, nbytes))  # numpy reads them without the GIL
                self._counted("read", total)
            except Exception as e:  # noqa: BLE001 - a hint; a failure must not end the thread
                log.warning("reading a pinned hit's pages ahead failed: %s", e)
            finally:
                with self._lock:
                    self._queued -= total
