"""Places counted per key (a uid, a session) and in all, each count capped: the arena
handout's connections, the query channels and the calls that wait in the daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable


class Places:
    """``take(key)`` counts one in, or says why not: ``over_one(held, per_key)`` when the key
    holds ``per_key`` already, ``over_all(held, total)`` when all keys hold ``total``;
    ``leave(key)`` counts one taken out. Thread-safe; the lock is never held with anything
    else taken inside."""

    def __init__(self, total: int, per_key: int, over_one: Callable[[int, int], str],
                 over_all: Callable[[int, int], str]) -> None:
        self.total, self.per_key = total, per_key
        self._over_one, self._over_all = over_one, over_all
        self._lock = threading.Lock()
        self._held: dict[Hashable, int] = {}
        self.held = 0  # taken in all

    def take(self, key: Hashable) -> str:
        """Take a place for ``key``: "" when taken, else why not."""
        with self._lock:
            mine = self._held.get(key, 0)
            if mine >= self.per_key:
                return self._over_one(mine, self.per_key)
            if self.held >= self.total:
                return self._over_all(self.held, self.total)
            self._held[key] = mine + 1
            self.held += 1
            return ""

    def leave(self, key: Hashable) -> None:
        """Give back a place ``key`` took."""
        with self._lock:
            self.held -= 1
            if self._held[key] == 1:
                del self._held[key]
            else:
                self._held[key] -= 1
