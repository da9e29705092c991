"""Who may be in a transfer listener's handshake, and until when: :class:`Handshakes`.

A connection takes a place when it is accepted and gives it back when its handshake is over,
either way. Each place has one deadline, counted from accept: a reaper thread drops the
connection when it passes, however the peer paces its bytes (a per-read timeout lets a peer
that sends one byte a second hold its place for ever).

Places are shared fairly, so an unauthenticated flood cannot keep a new sender out:

- one source address holds at most ``per_host`` places; its next connection is refused at once
  (a real sender dials once per pooled connection, and only handshakes count, not transfers);
- one source network (IPv4 /24, IPv6 /64: what one host, or one tenant's hosts, can have)
  holds at most ``per_net``, and all together at most ``total``. When either is full, a new
  connection still gets in: it takes the place of the oldest handshake of the address that
  holds the most places in the full group. A newcomer holds one place, a flooding address
  many, so the flood's own connections are the ones dropped. To keep a newcomer out the
  flood must hold every place with one connection per address (``total`` addresses in as many
  networks) and open ``total`` new ones within the newcomer's handshake (a round trip or two).

Thread-safe: one lock inside; the callbacks that drop a connection are called under it and must
not block (``socket.shutdown``, or queueing work for another thread).
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import threading
import time
from collections.abc import Callable
from enum import Enum


class Dropped(Enum):
    """Why a handshake's place was taken away before it finished."""

    DEADLINE = "deadline"    # not done within the deadline, counted from accept
    ADMISSION = "admission"  # its place went to a newcomer (its address held the most)


def network_of(address: str) -> str:
    """The source network an address is counted in: IPv4 /24, IPv6 /64 (an IPv4-mapped IPv6
    address as IPv4); a name that is not an address counts as its own network."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class Place:
    """One connection's place in the handshake. ``dropped`` is set (under the table's lock)
    when the table took it away; the connection's own thread reads it to say why it failed."""

    __slots__ = ("address", "network", "deadline", "seq", "drop", "dropped", "done")

    def __init__(self, address: str, deadline: float, seq: int, drop: Callable[[Dropped], None]) -> None:
        self.address, self.network = address, network_of(address)
        self.deadline, self.seq, self.drop = deadline, seq, drop
        self.dropped: Dropped | None = None
        self.done = False


class Handshakes:
    """The places of one listener (see the module's docstring). ``timeout_s``: the whole
    handshake's deadline. ``per_host`` None: addresses are not known (UCX), so only ``total``
    applies, and a full table gives the oldest place to a newcomer."""

    def __init__(self, timeout_s: float, *, per_host: int | None = 8, per_net: int = 64, total: int = 256,
                 clock: Callable[[], float] = time.monotonic, name: str = "kvt-handshakes") -> None:
        self.timeout_s, self.per_host, self.per_net, self.total = timeout_s, per_host, per_net, total
        self.clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._places: dict[int, Place] = {}         # seq -> place, oldest first (insertion order)
        self._by_host: dict[str, dict[int, Place]] = {}
        self._by_net: dict[str, int] = {}
        self._heap: list[tuple[float, int]] = []     # (deadline, seq)
        self._stopped = False
        self._reaper = threading.Thread(target=self._reap, name=name, daemon=True)
        self._reaper.start()

    def admit(self, address: str, drop: Callable[[Dropped], None]) -> Place | None:
        """A place for a connection from ``address`` (``drop(why)`` ends it early), or None when
        that address already holds ``per_host`` places: refuse the connection then."""
        with self._lock:
            mine = self._by_host.get(address, {})
            if self.per_host is not None and len(mine) >= self.per_host:
                return None
            if self.per_host is not None and self._by_net.get(network_of(address), 0) >= self.per_net:
                self._evict(network_of(address))
            if len(self._places) >= self.total:
                self._evict(None)
            place = Place(address, self.clock() + self.timeout_s, next(self._seq), drop)
            self._places[place.seq] = place
            self._by_host.setdefault(address, {})[place.seq] = place
            self._by_net[place.network] = self._by_net.get(place.network, 0) + 1
            heapq.heappush(self._heap, (place.deadline, place.seq))
            if self._heap[0][1] == place.seq:
                self._wake.notify()
            return place

    def finish(self, place: Place) -> Dropped | None:
        """The handshake is over (passed or failed): give the place back. Returns why the table
        dropped it first, if it did (then the failure is that, whatever the socket said)."""
        with self._lock:
            self._release(place)
            return place.dropped

    def count(self, address: str | None = None) -> int:
        """Places held, by ``address`` or in all."""
        with self._lock:
            return len(self._places) if address is None else len(self._by_host.get(address, ()))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._wake.notify()
        self._reaper.join(timeout=1.0)

    # -- under the lock ---------------------------------------------------------------------
    def _release(self, place: Place) -> None:
        if place.done:
            return
        place.done = True
        del self._places[place.seq]
        mine = self._by_host[place.address]
        del mine[place.seq]
        if not mine:
            del self._by_host[place.address]
        left = self._by_net[place.network] - 1
        if left:
            self._by_net[place.network] = left
        else:
            del self._by_net[place.network]

    def _take(self, place: Place, why: Dropped) -> None:
        place.dropped = why
        self._release(place)
        try:
            place.drop(why)
        except Exception:  # noqa: BLE001 - a socket already closed by its own thread
            pass

    def _evict(self, network: str | None) -> None:
        """Give the oldest place of the heaviest address (in ``network``, or anywhere) away."""
        if self.per_host is None:  # addresses unknown: the oldest of all
            self._take(next(iter(self._places.values())), Dropped.ADMISSION)
            return
        heaviest = max((h for h, mine in self._by_host.items()
                        if network is None or network_of(h) == network),
                       key=lambda h: (len(self._by_host[h]), -next(iter(self._by_host[h]))))
        self._take(next(iter(self._by_host[heaviest].values())), Dropped.ADMISSION)

    def _reap(self) -> None:
        with self._lock:
            while not self._stopped:
                while self._heap and self._heap[0][1] not in self._places:
                    heapq.heappop(self._heap)  # given back or dropped already
                if not self._heap:
                    self._wake.wait()
                    continue
                deadline, seq = self._heap[0]
                now = self.clock()
                if now < deadline:
                    self._wake.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                self._take(self._places[seq], Dropped.DEADLINE)
