"""Configuration of the daemon-to-daemon transport: which backend, where to listen, how long
anything may take. One frozen dataclass, handed to both :class:`~kvstore.transport.Listener`
and :class:`~kvstore.transport.Sender`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Callable

from .auth import TlsFiles, check_name

MiB = 1 << 20


class Backend(enum.Enum):
    """Wire backend. Both speak the same frame protocol (``protocol.py``)."""

    TCP = "tcp"
    UCX = "ucx"

    @classmethod
    def parse(cls, text: "str | Backend") -> "Backend":
        if isinstance(text, Backend):
            return text
        try:
            return cls(str(text).lower())
        except ValueError:
            raise ValueError(f"backend: unknown transport backend {text!r}; known: tcp, ucx") from None


class UcxProgress(enum.Enum):
    """How the UCX worker is progressed. ucxx's default 'thread' mode is not offered: it measured
    0.3-0.6 GB/s here against 5-9 GB/s for blocking mode."""

    ADAPTIVE = "adaptive"  # poll while a transfer is open on the engine, else sleep like BLOCKING
    BLOCKING = "blocking"  # sleep in epoll on the worker's event fd whenever idle
    POLLING = "polling"    # spin on progress() always; burns one core per engine even when idle


@dataclass(frozen=True, slots=True)
class TransferConfig:
    """Transport settings. Times are seconds, sizes bytes.

    ``host``/``port`` are where the :class:`Listener` binds (port 0 = any free port). The UCX
    listener binds every interface on ``port`` (ucxx 0.52 offers no bind address); ``host`` is
    then only the address it reports.

    Authentication (``auth.py``): with ``secret`` both ends prove they hold it (HMAC
    challenge-response, as ``node_name``) before any transfer frame is accepted; with ``tls``
    (TCP only) the connection is mutual TLS and a peer is its certificate's name. Neither: any
    peer that reaches the port is accepted; a daemon allows that only when told to.
    """

    backend: Backend = Backend.TCP
    host: str = "127.0.0.1"
    port: int = 0
    connect_timeout_s: float = 5.0
    default_deadline_s: float = 30.0      # a transfer opened without a deadline gets this one
    max_deadline_s: float = 600.0         # the receiver clamps what a sender asks for
    max_chunk_bytes: int = 256 * MiB      # larger chunks are refused (PROTOCOL_ERROR)
    max_blocks: int = 65536               # keys in one transfer
    max_meta_bytes: int = 64 * 1024
    max_inflight_bytes: int = 64 * MiB    # UCX sender: payload bytes posted, not completed (>= 1 chunk)
    secret: bytes = b""                   # cluster secret of the HMAC handshake (b"" = none)
    node_name: str = "kvstore"            # who this end says it is in the handshake
    tls: "TlsFiles | None" = None         # TCP: mutual TLS with these files
    ucx_progress: UcxProgress = UcxProgress.ADAPTIVE
    verify_threads: int = -1              # UCX receiver: threads hashing arrived payloads (-1 = auto)
    verify_min_bytes: int = 1 * MiB       # ... for payloads of at least this size (smaller: inline)
    ucx_fused_verify: bool = True         # UCX receiver without a pool: hash as UCX copies in (shared memory)
    tcp_keepalive_s: int = 5              # dead-host detection where no FIN/RST ever arrives
    # TCP receiver: decodes encoded chunks with decode(payload, dst) (ValueError: not a valid
    # payload for dst's size); None: takes raw chunks only (kvstore.codec.decode in a daemon)
    decode: Callable[[memoryview, memoryview], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", Backend.parse(self.backend))
        if isinstance(self.ucx_progress, str):
            object.__setattr__(self, "ucx_progress", UcxProgress(self.ucx_progress))
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {self.port}")
        for name in ("connect_timeout_s", "default_deadline_s", "max_deadline_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)}")
        if self.max_chunk_bytes <= 0 or self.max_inflight_bytes <= 0:
            raise ValueError("max_chunk_bytes, max_inflight_bytes: must be > 0")
        if self.verify_threads < -1 or self.verify_threads > 64:
            raise ValueError(f"verify_threads: must be -1 (auto) or 0..64, got {self.verify_threads}")
        if self.verify_min_bytes < 0:
            raise ValueError(f"verify_min_bytes: must be >= 0, got {self.verify_min_bytes}")
        check_name(self.node_name, "node_name")
        if self.tls is not None and self.backend is Backend.UCX:
            raise ValueError("tls: mutual TLS is for the tcp backend; UCX authenticates with the secret")

    def resolved_verify_threads(self, cpus: int | None = None) -> int:
        """How many threads verify arrived UCX payloads beside the engine thread. 0: the engine
        thread hashes each payload itself, between progress calls. Auto (-1) gives hosts of 4 or
        more CPUs a quarter of them, at most 4: with spare cores the receiver's engine then only
        copies, as raw UCX does; on 2 cores a helper thread only competed with both engines."""
        if self.verify_threads >= 0:
            return self.verify_threads
        cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        return 0 if cpus < 4 else min(4, cpus // 4)


def parse_peer(peer: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> ``(host, port)``."""
    host, sep, port = str(peer).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"peer: expected host:port, got {peer!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_peer(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
