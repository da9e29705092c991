"""The transfer listener a daemon runs beside its gRPC server: accepts peers and feeds every
incoming transfer into a :class:`~kvstore.transport.sink.Sink`.

    listener = Listener(config, sink)
    host, port = listener.start()      # binds; port 0 in the config picks a free one
    ...
    listener.stop()                    # running transfers end with SHUTDOWN, slots released

It runs on its own threads (TCP: one per connection; UCX: one progress thread), never on the
gRPC server's threads or event loop.
"""

from __future__ import annotations

import ipaddress
import os

from .config import Backend, TransferConfig, format_peer
from .sink import Sink


def listening_addresses(port: int, pid: int | str = "self") -> list[str]:
    """The addresses process ``pid`` listens on at TCP ``port``, as the kernel has them
    (/proc/net/tcp and tcp6, matched to the process's sockets): what a listener really bound,
    whatever it was asked for."""
    mine = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            addr, _, hexport = f[1].partition(":")
            if f[3] != "0A" or f[9] not in mine or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(str(ipaddress.IPv6Address(raw) if v6 else ipaddress.IPv4Address(raw)))
    return sorted(set(found))


class Listener:
    def __init__(self, config: TransferConfig, sink: Sink) -> None:
        self.config = config
        self.sink = sink
        self._server = None

    def start(self) -> tuple[str, int]:
        """Bind and start serving; returns the (host, port) peers should dial. Raises OSError
        (naming the address) when the port cannot be listened on."""
        if self._server is not None:
            raise RuntimeError("listener already started")
        if self.config.backend is Backend.UCX:
            from .ucx import UcxServer
            self._server = UcxServer(self.config, self.sink)
        else:
            from .tcp import TcpServer
            self._server = TcpServer(self.config, self.sink)
        return self._server.host, self._server.port

    @property
    def address(self) -> str:
        """``host:port`` of the running listener (what a Sender's ``open`` takes as ``peer``)."""
        if self._server is None:
            raise RuntimeError("listener not started")
        return format_peer(self._server.host, self._server.port)

    def bound(self) -> list[str]:
        """The addresses the running listener really listens on (UCX: every interface, "0.0.0.0")."""
        if self._server is None:
            raise RuntimeError("listener not started")
        return listening_addresses(self._server.port)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting and end every running transfer with SHUTDOWN. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.stop(timeout_s)

    def __enter__(self) -> "Listener":
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
