"""TCP backend: plain blocking sockets, one I/O thread per connection on each side.

Payloads go from the source buffer to the kernel with one ``sendmsg([header, payload])`` and
from the kernel straight into the sink's buffer with ``recv_into(..., MSG_WAITALL)``: no copy in
user space. Sockets stay in blocking mode (Python's own timeout mode would make them
non-blocking and turn every large recv into a poll+recv loop); deadlines are kernel timeouts
(SO_RCVTIMEO / SO_SNDTIMEO) re-armed from the transfer deadline before each frame.

With mutual TLS (``config.tls``) the socket is an :class:`ssl.SSLSocket`: no ``sendmsg``, no
MSG_WAITALL or MSG_PEEK, and OpenSSL retries a read that a kernel timeout interrupted, so a TLS
socket runs in Python's timeout mode instead (re-armed the same way) and payloads are decrypted
straight into the sink's buffer by ``recv_into``. The TLS handshake runs on the connection's own
thread, bounded by ``connect_timeout_s``, never on the accept thread.
"""

from __future__ import annotations

import collections
import logging
import select
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import Future

import xxhash
from concurrent.futures import TimeoutError as FutureTimeout

from .admission import Dropped, Handshakes
from .auth import HELLO_BYTES, AuthError, ClientHandshake, Peer, ServerHandshake, cert_identity, refusal
from .config import TransferConfig, format_peer
from .protocol import (FRAME_BYTES, Frame, FrameType, ProtocolError, TransferError, TransferStatus,
                       max_manifest_bytes, parse_status)
from .session import InboundSession, refused
from .sink import Sink

log = logging.getLogger("kvstore.transport")
_STATUS_DATA_MAX = 8192
_IOV_BATCH = 512             # iovecs per sendmsg (Linux allows 1024)
_BYTES_BATCH = 16 << 20      # bytes per sendmsg batch
# A chunk is received and hashed in pieces of this size: each piece is hashed while the
# kernel's copy has left it in cache (xxh3 ran 53 GB/s on cached data against 24 GB/s over a
# whole cold chunk here), and the chunk is never read back from memory just to be verified.
_HASH_PIECE = 512 << 10
# Places in the handshake (transport/admission.py): per source address, per source network
# (IPv4 /24, IPv6 /64) and in all. Each holds a thread for at most connect_timeout_s from
# accept; beyond the per-address cap a connection is closed at once, and a full network or
# table gives the place of the heaviest address's oldest handshake to the newcomer.
MAX_HANDSHAKES_PER_HOST = 8
MAX_HANDSHAKES_PER_NET = 64
MAX_HANDSHAKES = 256


def _lost(detail: str) -> TransferError:
    return TransferError(TransferStatus.PEER_LOST, detail)


def tune(sock: socket.socket, keepalive_s: int) -> None:
    """TCP_NODELAY (small frames must not wait for the next payload) and fast dead-peer
    detection where no FIN/RST ever arrives (host lost power, cable pulled)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, keepalive_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (keepalive_s + 3) * 1000)


def arm(sock: socket.socket, deadline: float | None) -> None:
    """Kernel send/receive timeouts reaching to ``deadline`` (monotonic s); None = wait forever.
    A TLS socket gets the same as its Python timeout."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise TransferError(TransferStatus.DEADLINE_EXCEEDED, "transfer deadline passed")
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(left)
        return
    if left is None:
        tv = struct.pack("ll", 0, 0)
    else:
        tv = struct.pack("ll", int(left), max(1, int((left % 1) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_into(sock: socket.socket, mv: memoryview, deadline: float | None) -> None:
    """Fill ``mv`` completely from ``sock``; PEER_LOST on EOF, DEADLINE_EXCEEDED on timeout."""
    got, n = 0, mv.nbytes
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < n:
        try:
            k = sock.recv_into(mv[got:], n - got, flags)
        except (BlockingIOError, TimeoutError):
            arm(sock, deadline)  # raises once the deadline has passed; else the timer re-arms
            continue
        except OSError as exc:
            raise _lost(f"connection reset while receiving: {exc.strerror or exc}") from None
        if k == 0:
            raise _lost("connection closed by the peer")
        got += k
        if got < n and deadline is not None and (flags or (sock.gettimeout() or 1e9) > deadline - time.monotonic() + 0.05):
            # A short read under MSG_WAITALL ran out the kernel timer; a TLS socket's timer
            # counts per record. Re-armed to what is left, a peer that trickles bytes cannot
            # stretch the deadline read by read.
            arm(sock, deadline)


def recv_hashed(sock: socket.socket, mv: memoryview, deadline: float | None) -> int:
    """Fill ``mv`` from ``sock`` like :func:`recv_into`; returns the xxh3 of what arrived
    (the same digest as :func:`~kvstore.transport.protocol.checksum` of ``mv``)."""
    h = xxhash.xxh3_64()
    for off in range(0, mv.nbytes, _HASH_PIECE):
        piece = mv[off:off + _HASH_PIECE]
        recv_into(sock, piece, deadline)
        h.update(piece)
    return h.intdigest()


def send_all(sock: socket.socket, bufs: list, deadline: float | None) -> None:
    """``sendmsg`` every byte of ``bufs`` (a header and a payload: no joining copy)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        return _send_tls(sock, views)
    while views:
        try:
            k = sock.sendmsg(views)
        except (BlockingIOError, TimeoutError):
            arm(sock, deadline)
            continue
        except OSError as exc:
            raise _lost(f"connection lost while sending: {exc.strerror or exc}") from None
        while k and views:
            if k >= views[0].nbytes:
                k -= views.pop(0).nbytes
            else:
                views[0] = views[0][k:]
                k = 0


def _send_tls(sock: ssl.SSLSocket, views: list[memoryview]) -> None:
    """``send_all`` on TLS: small pieces (frame headers, run digests) joined into one record
    with the payload that follows them, each large payload encrypted straight from its buffer.
    A send that timed out may have left part of a record: the transfer is over then."""
    small: list[memoryview] = []
    try:
        for v in views:
            if v.nbytes < 64 << 10:
                small.append(v)
                continue
            if small:
                sock.sendall(b"".join(small))
                small = []
            sock.sendall(v)
        if small:
            sock.sendall(b"".join(small))
    except TimeoutError:
        raise TransferError(TransferStatus.DEADLINE_EXCEEDED, "transfer deadline passed while sending") from None
    except OSError as exc:
        raise _lost(f"connection lost while sending: {exc.strerror or exc}") from None


def _readable(sock: socket.socket) -> bool:
    """Whether a TLS socket has anything to read (decrypted bytes held, or bytes on the wire)."""
    return bool(sock.pending()) or bool(select.select([sock], [], [], 0)[0])


def read_frame(sock: socket.socket, deadline: float | None, max_data: int) -> tuple[Frame, bytes]:
    """Read one frame header and its data; for a CHUNK that is only a run's layer digests (the
    caller receives the payload into the sink's buffer)."""
    raw = bytearray(FRAME_BYTES)
    recv_into(sock, memoryview(raw), deadline)
    frame = Frame.unpack(bytes(raw))
    if frame.type is FrameType.CHUNK:
        trailer = bytearray(frame.trailer_bytes)
        if trailer:
            recv_into(sock, memoryview(trailer), deadline)
        return frame, bytes(trailer)
    if frame.length > max_data:
        raise ProtocolError(f"{frame.type.name} frame carries {frame.length} bytes, at most {max_data}")
    data = bytearray(frame.length)
    recv_into(sock, memoryview(data), deadline)
    return frame, bytes(data)


def send_hello(sock: socket.socket, msg: bytes, deadline: float) -> None:
    send_all(sock, [Frame(FrameType.HELLO, length=len(msg)).pack(), msg], deadline)


def read_hello(sock: socket.socket, deadline: float) -> bytes:
    frame, data = read_frame(sock, deadline, HELLO_BYTES)
    if frame.type is not FrameType.HELLO:
        raise AuthError(f"handshake: expected HELLO, got {frame.type.name}", "protocol")
    return data


# -- sending side --------------------------------------------------------------------------------

class TcpConnector:
    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        self._tls = config.tls.context(server=False) if config.tls is not None else None

    def connect(self, host: str, port: int, timeout_s: float) -> "TcpChannel":
        peer = format_peer(host, port)
        deadline = time.monotonic() + timeout_s
        try:
            sock = socket.create_connection((host, port), timeout=max(timeout_s, 1e-3))
        except OSError as exc:
            raise TransferError(TransferStatus.CONNECT_FAILED, f"cannot connect to {peer}: {exc}") from None
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock)
            except (ssl.SSLError, OSError) as exc:
                sock.close()
                raise AuthError(f"TLS handshake with {peer} failed: {getattr(exc, 'reason', None) or exc}",
                                "tls") from None
        else:
            sock.settimeout(None)
        tune(sock, self.config.tcp_keepalive_s)
        hs = ClientHandshake(self.config.secret, self.config.node_name)
        try:
            arm(sock, deadline)
            send_hello(sock, hs.first(), deadline)
            send_hello(sock, hs.third(read_hello(sock, deadline)), deadline)
            hs.done(read_hello(sock, deadline))
        except AuthError as exc:
            if not exc.by_peer:  # we refuse the listener: tell it why
                try:
                    send_hello(sock, refusal(3, exc), time.monotonic() + 0.5)
                except TransferError:
                    pass
            sock.close()
            raise AuthError(f"{peer}: {exc.detail}", exc.reason) from None
        except TransferError as exc:
            sock.close()
            if self._tls is not None and exc.status is TransferStatus.PEER_LOST:
                # TLS 1.3: the listener checks our certificate after our side of the handshake
                # is over, and says no by closing (an alert) when we first read.
                raise AuthError(f"{peer} closed the connection during the handshake ({exc.detail}): does it "
                                f"trust this daemon's certificate (transport.tls_ca_file there)?", "tls") from None
            raise TransferError(TransferStatus.CONNECT_FAILED, f"handshake with {peer} failed: {exc}") from None
        return TcpChannel(sock, peer)

    def close(self) -> None:
        pass


class TcpChannel:
    """Client end of one connection. Chunks and control frames go through one queue drained by
    one I/O thread, so END can never overtake a chunk."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer
        self._deadline: float | None = None
        self._error: TransferError | None = None
        self._closed = False
        self._q: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"kvt-tcp-send {peer}", daemon=True)
        self._thread.start()

    def set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline

    def error(self) -> TransferError | None:
        return self._error

    def alive(self) -> bool:
        if self._error is not None or self._closed:
            return False
        if isinstance(self.sock, ssl.SSLSocket):
            return not _readable(self.sock)
        try:  # an idle connection has nothing to read: EOF or stray bytes both mean unusable
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _put(self, item) -> None:
        with self._cv:
            if self._closed:
                raise TransferError(TransferStatus.ABORTED, "connection is closed")
            self._q.append(item)
            self._cv.notify()

    def post_chunk(self, frame: Frame, wire, trailer: bytes = b"") -> None:
        self._put(("chunk", frame, trailer, wire))

    def abort(self, frame: Frame, data: bytes) -> None:
        fut: Future = Future()
        with self._cv:
            if not self._closed and self._error is None:
                self._q.clear()  # queued chunks no longer matter
                self._q.append(("post", frame, data, fut))
                self._cv.notify()
            else:
                fut.set_result(None)
        try:
            fut.result(timeout=0.5)
        except Exception:
            pass
        self.close()

    def call(self, frame: Frame, data: bytes, deadline: float) -> tuple[Frame, bytes]:
        fut: Future = Future()
        self._put(("call", frame, data, fut))
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()) + 0.5)
        except FutureTimeout:
            raise TransferError(TransferStatus.DEADLINE_EXCEEDED, f"no answer from {self.peer} in time") from None

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if self._closed and not self._q:
                    return
                kind, frame, data, extra = self._q.popleft()
                batch = [frame.pack(), data, extra] if kind == "chunk" else None  # header, run digests, payload
                # Chunks already queued behind this one go out in the same sendmsg: one syscall
                # and one wake-up for many small chunks (a 64 KiB chunk is ~20 us of wire here).
                nbytes = frame.length
                while batch and self._q and self._q[0][0] == "chunk" and len(batch) < _IOV_BATCH \
                        and nbytes < _BYTES_BATCH:
                    _, f, trailer, wire = self._q.popleft()
                    batch += (f.pack(), trailer, wire)
                    nbytes += f.length
            fut = extra if kind != "chunk" else None
            try:
                if self._error is not None:
                    raise self._error
                if kind == "chunk":  # frames carry the checksum of the source; the wire bytes follow
                    self._check_incoming()
                    send_all(self.sock, batch, self._deadline)
                else:
                    send_all(self.sock, [frame.pack(), data], self._deadline)
                if kind == "call":
                    fut.set_result(read_frame(self.sock, self._deadline, _STATUS_DATA_MAX))
                elif fut is not None:
                    fut.set_result(None)
            except TransferError as err:
                if self._error is None:
                    self._error = self._explain(err)
                if fut is not None:
                    fut.set_exception(self._error)
            except Exception as exc:  # never leave a caller waiting on a dead thread
                self._error = self._error or TransferError(TransferStatus.PROTOCOL_ERROR, repr(exc))
                if fut is not None:
                    fut.set_exception(self._error)

    def _check_incoming(self) -> None:
        """A receiver that failed the transfer says so (ERROR frame) and closes: stop early."""
        if isinstance(self.sock, ssl.SSLSocket):
            if _readable(self.sock):
                frame, data = read_frame(self.sock, self._deadline, _STATUS_DATA_MAX)
                raise parse_status(frame, data) or ProtocolError(f"unexpected {frame.type.name} during transfer")
            return
        try:
            peek = self.sock.recv(FRAME_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise _lost(f"connection to {self.peer} reset: {exc}") from None
        if not peek:
            raise _lost(f"{self.peer} closed the connection")
        frame, data = read_frame(self.sock, self._deadline, _STATUS_DATA_MAX)
        raise parse_status(frame, data) or ProtocolError(f"unexpected {frame.type.name} during transfer")

    def _explain(self, err: TransferError) -> TransferError:
        """A send that failed because the receiver gave up: report the receiver's reason."""
        if err.status is not TransferStatus.PEER_LOST:
            return err
        try:
            frame, data = read_frame(self.sock, time.monotonic() + 0.2, _STATUS_DATA_MAX)
            return parse_status(frame, data) or err
        except Exception:
            return err

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for kind, _frame, _data, extra in self._q:  # nobody may wait on a dropped request
                if kind != "chunk" and not extra.done():
                    extra.set_exception(TransferError(TransferStatus.ABORTED, "connection closed"))
            self._q.clear()
            self._cv.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes an I/O thread blocked in sendmsg/recv
        except OSError:
            pass
        self._thread.join(timeout=10.0)
        self.sock.close()


# -- receiving side ------------------------------------------------------------------------------

class TcpServer:
    """Accepts connections; serves each on its own thread with an :class:`InboundSession`, once
    the peer passed the handshake (TLS and/or the secret) within ``connect_timeout_s``."""

    def __init__(self, config: TransferConfig, sink: Sink) -> None:
        self.config, self.sink = config, sink
        self._tls = config.tls.context(server=True) if config.tls is not None else None
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self._lsock = socket.socket(family, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on the same port
        try:
            self._lsock.bind((config.host, config.port))
            self._lsock.listen(1024)  # a flood's connections must not crowd a sender out of the backlog
        except OSError as exc:
            self._lsock.close()
            raise OSError(exc.errno, f"transfer listener cannot listen on "
                                     f"{format_peer(config.host, config.port)}: {exc.strerror}") from None
        self.host, self.port = self._lsock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._places = Handshakes(config.connect_timeout_s, per_host=MAX_HANDSHAKES_PER_HOST,
                                  per_net=MAX_HANDSHAKES_PER_NET, total=MAX_HANDSHAKES)
        self._max_ctrl = max_manifest_bytes(config.max_blocks, config.max_meta_bytes)
        self._accept_thread = threading.Thread(target=self._accept, name="kvt-tcp-accept", daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, addr = self._lsock.accept()
            except OSError:
                return  # listening socket shut down by stop()
            address = format_peer(*addr[:2])
            # The reaper cuts a handshake off through its own descriptor of the socket: one that
            # shutdown() reaches whatever the handshake thread has wrapped the socket in.
            try:
                cut = sock.dup()
            except OSError:  # out of descriptors: this one cannot be served
                sock.close()
                continue
            place = self._places.admit(addr[0], lambda _why, cut=cut: cut.shutdown(socket.SHUT_RDWR))
            if place is None:
                cut.close()
                sock.close()
                refused(self.sink, address, AuthError(
                    f"{MAX_HANDSHAKES_PER_HOST} connections of this address are in their handshake: closed at once",
                    "admission"))
                continue
            with self._lock:
                if self._stopping:
                    self._places.finish(place)
                    cut.close()
                    sock.close()
                    return
                self._conns.add(sock)
                t = threading.Thread(target=self._serve, args=(sock, address, place, cut),
                                     name=f"kvt-tcp-recv {addr[0]}", daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _handshake(self, sock: socket.socket, address: str, place) -> tuple[socket.socket, Peer] | None:
        """TLS (if configured), then the HELLO exchange, all by ``place.deadline`` (counted from
        accept; the reaper shuts the socket down then, whatever the peer sends); the socket to
        serve and who is on it, or None once a refused peer has been told why, reported and
        closed."""
        deadline = place.deadline
        try:
            try:
                tune(sock, self.config.tcp_keepalive_s)
                if self._tls is not None:
                    sock.settimeout(max(1e-3, deadline - time.monotonic()))
                    try:
                        plain = sock.recv(1, socket.MSG_PEEK) not in (b"\x16", b"")  # 0x16: a TLS handshake record
                    except OSError:
                        plain = False
                    if plain:  # a plaintext peer can read a plaintext refusal that says why
                        raise AuthError("this listener requires mutual TLS (transport.tls_*); the peer spoke "
                                        "plaintext", "tls-plain")
                    tls_sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                    with self._lock:  # stop() must shut down the socket now in use
                        self._conns.discard(sock)
                        self._conns.add(tls_sock)
                    sock = tls_sock
                    sock.settimeout(max(1e-3, deadline - time.monotonic()))
                    try:
                        sock.do_handshake()
                    except (ssl.SSLError, OSError) as exc:
                        if isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
                            # A trickling or silent peer: the socket's own timeout (the deadline)
                            # can fire before the reaper cuts it off; it is a missed deadline,
                            # not a TLS failure (CI counted one as "tls" when it came first).
                            raise TransferError(TransferStatus.DEADLINE_EXCEEDED, "TLS handshake unfinished") from None
                        raise AuthError(f"TLS: {getattr(exc, 'reason', None) or exc}", "tls") from None
                hs = ServerHandshake(self.config.secret, self.config.node_name)
                arm(sock, deadline)
                send_hello(sock, hs.second(read_hello(sock, deadline)), deadline)
                send_hello(sock, hs.fourth(read_hello(sock, deadline)), deadline)
            finally:
                dropped = self._places.finish(place)
            if dropped is not None:  # it finished just as the reaper cut it off: it is cut off
                raise TransferError(TransferStatus.DEADLINE_EXCEEDED, "cut off")
        except TransferError as err:
            if dropped is Dropped.DEADLINE or (dropped is None and err.status is TransferStatus.DEADLINE_EXCEEDED):
                err = AuthError(f"handshake not completed within {self.config.connect_timeout_s:g} s of accept",
                                "deadline")
            elif dropped is Dropped.ADMISSION:
                err = AuthError("handshake dropped: its place went to a new connection (this address held the "
                                "most places in its network or in all)", "admission")
            elif not isinstance(err, AuthError):
                err = AuthError(f"handshake not completed: {err.detail}", "protocol")
            answer = err.reason not in ("tls", "deadline", "admission")  # not into TLS, nor to the silent or cut off
            if err.reason == "tls-plain":
                err.reason = "tls"
            refused(self.sink, address, err)
            with self._lock:
                self._conns.discard(sock)
            self._close(sock, (Frame(FrameType.HELLO, length=HELLO_BYTES), refusal(0, err)) if answer else None)
            return None
        if self._tls is not None:
            return sock, Peer(cert_identity(sock), address, "tls")
        return sock, Peer(hs.peer_name if self.config.secret else "", address, "hmac" if self.config.secret else "none")

    def _serve(self, raw: socket.socket, address: str, place, cut: socket.socket) -> None:
        try:
            got = self._handshake(raw, address, place)
        finally:
            cut.close()  # the place is given back: the reaper no longer reaches this socket
        if got is None:
            return
        sock, peer = got
        session = InboundSession(self.config, self.sink, address, decodes=True)
        session.authenticated(peer)
        try:
            while True:
                dl = session.deadline
                if dl is not None and time.monotonic() >= dl:  # a sender trickling bytes
                    raise session.expire()
                arm(sock, dl)
                frame, data = read_frame(sock, dl, self._max_ctrl)
                if frame.type is FrameType.CHUNK:
                    mv = session.chunk_buffer(frame)
                    sent = session.run_digests(frame, data)
                    if frame.status:  # encoded: received whole, decoded into place, then hashed
                        recv_into(sock, mv, dl)
                        session.chunk_landed(frame, mv, sent)
                        continue
                    c = session.active.header.chunk_bytes  # a run: each layer hashed as it lands
                    session.chunk_verified(frame, recv_hashed(sock, mv, dl) if mv.nbytes == c else
                                           [recv_hashed(sock, mv[o:o + c], dl) for o in range(0, mv.nbytes, c)], sent)
                    continue
                reply = session.on_control(frame, data)
                if reply is not None:
                    send_all(sock, [reply[0].pack(), reply[1]], time.monotonic() + self.config.connect_timeout_s)
        except TransferError as err:
            if self._stopping:
                err = TransferError(TransferStatus.SHUTDOWN, "receiving daemon is shutting down")
            elif err.status is TransferStatus.DEADLINE_EXCEEDED:
                err = session.expire() or err
            self._close(sock, session.fail(err))
        except Exception as exc:
            log.exception("transfer connection from %s failed", session.peer)
            self._close(sock, session.fail(TransferError(TransferStatus.PROTOCOL_ERROR, repr(exc))))
        finally:
            with self._lock:
                self._conns.discard(sock)

    def _close(self, sock: socket.socket, reply) -> None:
        """Best-effort ERROR frame, then FIN and a short drain so the kernel does not answer the
        sender's in-flight data with a RST that could discard our ERROR frame before it is read."""
        try:
            if reply is not None:
                send_all(sock, [reply[0].pack(), reply[1]], time.monotonic() + 0.5)
            sock.shutdown(socket.SHUT_WR)
            if isinstance(sock, ssl.SSLSocket):  # unwrapped by shutdown: what is left is raw bytes
                sock.settimeout(0.1)
            else:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
            junk = bytearray(1 << 16)
            end = time.monotonic() + 0.3
            while time.monotonic() < end and sock.recv_into(junk):
                pass
        except (OSError, TransferError):
            pass
        sock.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting; running transfers end with SHUTDOWN (their slots released)."""
        with self._lock:
            self._stopping = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._places.stop()
        end = time.monotonic() + timeout_s
        for t in [self._accept_thread, *threads]:
            t.join(timeout=max(0.0, end - time.monotonic()))
