"""``namespaces.json`` in the NVMe directory: the description of every namespace whose blocks
the NVMe tier may hold, so that a restarted daemon can tell what its blocks are (a key alone
does not say its model, layout or block size). Blocks of a namespace the file does not
describe are dropped at recovery.

The file holds tenant salts: it is 0600 whatever the umask, and replaced atomically (a
temporary file of the writer's own, fsynced, renamed over it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import threading
import time

from kvstore.keys import Namespace
from kvstore.tiers.nvme.files import PRIVATE_FILE

log = logging.getLogger("kvstore.daemon.tiering")

FILE_NAME = "namespaces.json"


class NamespaceFile:
    """The namespaces of one NVMe directory ``dir``, as read at start (:meth:`read`) and added
    by :meth:`remember` since. Safe to call from several threads."""

    def __init__(self, dir: str) -> None:
        self.path = os.path.join(dir, FILE_NAME)
        self._known: dict[str, dict] = {}  # namespace id (hex) -> Namespace.to_dict(), as on disk
        self._lock = threading.Lock()  # one writer at a time

    def read(self) -> list[Namespace]:
        """The namespaces the file describes. A file that is not what :meth:`remember` writes
        (unreadable, not JSON, the wrong shape, an entry that does not parse or whose id is not
        its hash) is logged and moved aside as ``namespaces.json.bad-<time>`` for a look, never
        a traceback: the blocks of the namespaces it cannot vouch for are dropped and the
        entries it can are written back at once."""
        try:  # never blocking: a FIFO or a link in its place is moved aside, not waited on
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError("not a regular file")
                os.fchmod(fd, PRIVATE_FILE)  # older daemons left it world-readable; it holds tenant salts
                known = json.loads(f.read())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            self._quarantine(f"unreadable ({e})")
            return []
        if not isinstance(known, dict):
            self._quarantine(f"must be a JSON object of namespace id -> namespace, got {type(known).__name__}")
            return []
        good, bad = [], []
        with self._lock:
            for hex_id, d in known.items():
                try:
                    ns = Namespace.from_dict(d)
                except ValueError as e:
                    bad.append(f"{hex_id[:16]}: {e}")
                    continue
                if ns.root.hex() != hex_id:
                    bad.append(f"{hex_id[:16]}: the id is not the hash of the namespace it names")
                    continue
                good.append(ns)
                self._known[hex_id] = d
            if bad:
                self._quarantine(f"{len(bad)} of {len(known)} entries unreadable ({'; '.join(bad[:3])})")
                try:
                    self._write(self._known)
                except OSError as e:  # the next Register writes it again
                    log.error("cannot write %s back: %s", self.path, e)
        return good

    def remember(self, ns: Namespace) -> None:
        """Add ``ns`` to the file (nothing if it is there already); raises OSError if the file
        cannot be written."""
        hex_id = ns.root.hex()
        # Registers run on several gRPC workers at once (a TP=8 engine registers 8 namespaces
        # together): one writer at a time, each writing the whole file from a snapshot; the new
        # entry counts only once it is on disk, so a write that failed is tried again by the
        # next Register.
        with self._lock:
            if hex_id in self._known:
                return
            known = {**self._known, hex_id: ns.to_dict()}
            self._write(known)
            self._known = known

    def _quarantine(self, why: str) -> None:
        aside = f"{self.path}.bad-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            os.replace(self.path, aside)
        except OSError as e:
            log.error("%s: %s; cannot move it aside (%s): NVMe blocks of the namespaces it does not describe "
                      "are dropped", self.path, why, e)
            return
        log.error("%s: %s; quarantined as %s: NVMe blocks of the namespaces it does not describe are dropped",
                  self.path, why, aside)

    def _write(self, known: dict) -> None:
        """Replace the file atomically with ``known``: through a temporary file of this call's
        own, 0600 whatever the umask."""
        fd, tmp = tempfile.mkstemp(prefix="namespaces.", suffix=".tmp", dir=os.path.dirname(self.path))
        try:
            with os.fdopen(fd, "w") as f:
                os.fchmod(fd, PRIVATE_FILE)
                json.dump(known, f)
                f.flush()
                os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
