"""Who is on the other end of a transfer connection: the handshake both backends run before any
frame of a transfer is accepted, the cluster secret it proves knowledge of, and TLS contexts.

Handshake (four fixed-size messages, :class:`Hello`; TCP carries them in HELLO frames, UCX over
its stream API)::

    dialer                                             listener
    1  mode, nonce_c (32 random bytes), name_c  ---->
                                                <----  2  mode, nonce_s, name_s, proof_s
    3  proof_c  ------------------------------------>
                                                <----  4  verdict (status 0 = go on)

    proof_s = HMAC-SHA256(secret, "server" | nonce_c | nonce_s | name_c | name_s)
    proof_c = HMAC-SHA256(secret, "client" | nonce_c | nonce_s | name_c | name_s)

Each side proves it holds the secret over a nonce the *other* side just drew, so nothing
recorded from an earlier connection verifies again (replay), and the two proofs carry different
labels, so a listener's proof can never be reflected back to it as a dialer's. The secret never
travels. Both names are inside both proofs: a node's name cannot be changed on the wire. Every
holder of the secret can claim any name, though: names separate peers only as far as the
holders of the secret are trusted (mutual TLS gives each node its own credential).

Any step may instead carry a refusal (``status`` != 0, ``detail`` saying why); the refusing
side then closes. Mode ``NONE`` (no secret configured) runs the same four steps without proofs:
on TCP inside mutual TLS (the certificate is the identity), or on a fabric explicitly trusted.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import hmac
import os
import re
import socket
import ssl
import stat
import struct
from dataclasses import dataclass

from .protocol import MAGIC, VERSION, ProtocolError, TransferError, TransferStatus

NONCE_BYTES = 32
SECRET_MIN_BYTES = 16
SECRET_MAX_BYTES = 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}$")
# magic, version, rx (UCX receive prefix), step, mode, status, reason (of a refusal), nonce,
# name len, name, proof, detail len, detail
_MSG = struct.Struct("<IIIBBHB32sB64s32sH192s")
# AuthError.reason, as a refusal carries it (by index: new reasons go at the end). "timeout" is
# an older daemon's name for "deadline".
REASONS = ("protocol", "tls", "hmac", "mode", "timeout", "deadline", "admission")
HELLO_BYTES = _MSG.size


class Mode(enum.IntEnum):
    NONE = 0  # no proof: inside mutual TLS, or on a fabric configured as trusted
    HMAC = 1  # the cluster secret, challenge-response


class AuthError(TransferError):
    """The peer did not authenticate (or refused us); nothing of a transfer was accepted."""

    def __init__(self, detail: str, reason: str = "hmac", by_peer: bool = False) -> None:
        super().__init__(TransferStatus.UNAUTHENTICATED, detail)
        self.reason = reason  # label of kvstore_transfer_auth_failures_total: tls, hmac, mode, deadline, admission, protocol
        self.by_peer = by_peer  # the other side refused (it said why), rather than this side


@dataclass(frozen=True, slots=True)
class Peer:
    """The other end of an accepted connection. ``name``: its certificate's subject CN (or first
    DNS name) under TLS, the node name it proved with the secret under HMAC, "" when
    unauthenticated. ``via``: "tls", "hmac" or "none"."""

    name: str
    address: str
    via: str = "none"


@dataclass(frozen=True, slots=True)
class Hello:
    step: int
    mode: Mode = Mode.NONE
    rx: int = 0
    nonce: bytes = bytes(NONCE_BYTES)
    name: str = ""
    proof: bytes = bytes(32)
    status: int = 0  # a TransferStatus: 0 = go on, else a refusal
    detail: str = ""
    reason: str = "protocol"

    def pack(self) -> bytes:
        name, detail = self.name.encode(), self.detail.encode()[:192]
        return _MSG.pack(MAGIC, VERSION, self.rx, self.step, int(self.mode), self.status,
                         REASONS.index(self.reason) if self.reason in REASONS else 0, self.nonce,
                         len(name), name, self.proof, len(detail), detail)

    @classmethod
    def unpack(cls, raw: bytes, step: int) -> "Hello":
        """Parse handshake message ``step``; a refusal raises AuthError with the peer's reason."""
        if len(raw) != HELLO_BYTES:
            raise AuthError(f"handshake message of {len(raw)} bytes, expected {HELLO_BYTES}", "protocol")
        magic, version, rx, got_step, mode, status, reason, nonce, nlen, name, proof, dlen, detail = _MSG.unpack(raw)
        if magic != MAGIC or version != VERSION:
            raise ProtocolError(f"handshake: magic {magic:#x} version {version}, expected {MAGIC:#x} v{VERSION} "
                                f"(a kvstore transfer listener of the same version)")
        if status:
            raise AuthError("peer refused the handshake: " + detail[:min(dlen, 192)].decode(errors="replace"),
                            REASONS[reason] if reason < len(REASONS) else "protocol", by_peer=True)
        if got_step != step:
            raise AuthError(f"handshake: got step {got_step}, expected {step}", "protocol")
        try:
            mode = Mode(mode)
            name = name[:min(nlen, 64)].decode()
        except (ValueError, UnicodeDecodeError):
            raise AuthError("handshake: bad mode or name", "protocol") from None
        return cls(step, mode, rx, nonce, name, proof, 0, "")


def refusal(step: int, err: AuthError) -> bytes:
    """Handshake message ``step`` that refuses, saying why (never anything secret)."""
    return Hello(step, status=int(TransferStatus.UNAUTHENTICATED), detail=err.detail, reason=err.reason).pack()


def check_name(name: str, key: str = "node name") -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"{key}: {name!r} must be 1-64 characters of letters, digits and ._:@- "
                         f"(starting with a letter or digit)")
    return name


def default_node_name() -> str:
    """This host's name, cut to what a handshake carries."""
    name = re.sub(r"[^A-Za-z0-9._:@-]", "-", socket.gethostname())[:64].lstrip("._:@-")
    return name or "kvstore"


def _proof(secret: bytes, label: bytes, nonce_c: bytes, nonce_s: bytes, name_c: str, name_s: str) -> bytes:
    names = b"".join(len(n).to_bytes(1, "little") + n for n in (name_c.encode(), name_s.encode()))
    return hmac.new(secret, b"kvstore-transfer-auth-v1\0" + label + b"\0" + nonce_c + nonce_s + names,
                    hashlib.sha256).digest()


def _mode(secret: bytes) -> Mode:
    return Mode.HMAC if secret else Mode.NONE


class ClientHandshake:
    """The dialling side: :meth:`first`, then :meth:`third` with the listener's answer, then
    :meth:`done` with its verdict. Raises AuthError on anything that does not verify."""

    def __init__(self, secret: bytes, name: str, rx: int = 0) -> None:
        self.secret, self.name, self.rx = secret, name, rx
        self.nonce = os.urandom(NONCE_BYTES)
        self.peer_name = ""
        self.peer_rx = 0
        self._nonce_s = b""

    def first(self) -> bytes:
        return Hello(1, _mode(self.secret), self.rx, self.nonce, self.name).pack()

    def third(self, raw: bytes) -> bytes:
        h = Hello.unpack(raw, 2)
        if h.mode is not _mode(self.secret):
            raise AuthError(f"the listener runs handshake mode {h.mode.name} and this daemon {_mode(self.secret).name}: "
                            f"both ends need the same transport.secret_file (or neither)", "mode")
        if h.mode is Mode.HMAC and not hmac.compare_digest(
                h.proof, _proof(self.secret, b"server", self.nonce, h.nonce, self.name, h.name)):
            raise AuthError(f"the listener (claiming to be {h.name!r}) could not prove it holds the cluster secret")
        self.peer_name, self.peer_rx, self._nonce_s = h.name, h.rx, h.nonce
        proof = _proof(self.secret, b"client", self.nonce, h.nonce, self.name, h.name) if self.secret else bytes(32)
        return Hello(3, _mode(self.secret), self.rx, proof=proof).pack()

    def done(self, raw: bytes) -> None:
        Hello.unpack(raw, 4)


class ServerHandshake:
    """The listening side: :meth:`second` answers the dialer's first message, :meth:`fourth`
    checks its proof; then ``peer_name`` is who it is. Raises AuthError (send :func:`refusal`)."""

    def __init__(self, secret: bytes, name: str, rx: int = 0) -> None:
        self.secret, self.name, self.rx = secret, name, rx
        self.nonce = os.urandom(NONCE_BYTES)
        self.peer_name = ""
        self.peer_rx = 0
        self._nonce_c = b""

    def second(self, raw: bytes) -> bytes:
        h = Hello.unpack(raw, 1)
        if h.mode is not _mode(self.secret):
            raise AuthError("this listener requires the cluster secret (transport.secret_file); the peer sent no proof"
                            if self.secret else "this listener has no cluster secret configured; the peer has one",
                            "mode")
        try:
            check_name(h.name)
        except ValueError as e:
            raise AuthError(f"handshake: {e}", "protocol") from None
        self.peer_name, self.peer_rx, self._nonce_c = h.name, h.rx, h.nonce
        proof = _proof(self.secret, b"server", h.nonce, self.nonce, h.name, self.name) if self.secret else bytes(32)
        return Hello(2, _mode(self.secret), self.rx, self.nonce, self.name, proof).pack()

    def fourth(self, raw: bytes) -> bytes:
        h = Hello.unpack(raw, 3)
        if self.secret and not hmac.compare_digest(
                h.proof, _proof(self.secret, b"client", self._nonce_c, self.nonce, self.peer_name, self.name)):
            raise AuthError(f"peer claiming to be {self.peer_name!r} could not prove it holds the cluster secret")
        return Hello(4, _mode(self.secret), self.rx).pack()


# -- credentials from files ----------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _not_regular(key: str, path: str, mode: int) -> ValueError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return ValueError(f"{key}: {path} is {kind}, not a regular file")


def open_regular(path: str, key: str, follow: bool = True) -> int:
    """A read-only descriptor of ``path``, which must be a regular file, opened without ever
    blocking: O_NONBLOCK (opening a FIFO for reading would wait for a writer for ever, and no
    signal ends that open), O_NOFOLLOW unless ``follow`` (Kubernetes Secret volumes and cert
    managers link their files; a secret of our own must be the file itself). Raises
    ValueError naming ``key`` and what ``path`` is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise ValueError(f"{key}: {path} is a symbolic link; name the file itself") from None
        if e.errno == errno.ENXIO:  # what opening a unix socket gives
            raise ValueError(f"{key}: {path} is a socket, not a regular file") from None
        raise ValueError(f"{key}: cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(key, path, st.st_mode)
    return fd


def read_regular(path: str, key: str, max_bytes: int = 1 << 20, follow: bool = True) -> bytes:
    """The contents of the regular file ``path`` (at most ``max_bytes``), by :func:`open_regular`."""
    fd = open_regular(path, key, follow)
    try:
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{key}: {path} is larger than {max_bytes} bytes")
    return data


def read_secret(path: str, key: str = "transport.secret_file") -> bytes:
    """The cluster secret in ``path`` (surrounding whitespace dropped). The file must be a regular
    file (not a link) owned by this process's user and readable by nobody else (mode 0600 or
    0400), and hold 16 to 4096 bytes. Raises ValueError naming ``key``, at once whatever the
    path is (a FIFO, a socket, a directory, a link); the message never holds the secret."""
    fd = open_regular(path, key, follow=False)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ValueError(f"{key}: {path} belongs to uid {st.st_uid}, not to this daemon's user "
                             f"(uid {os.geteuid()}); chown it")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"{key}: {path} is readable or writable by group or others (mode "
                             f"{stat.S_IMODE(st.st_mode):04o}); chmod 0600 it")
        data = os.read(fd, SECRET_MAX_BYTES + 1)
    finally:
        os.close(fd)
    secret = data.strip()
    if not SECRET_MIN_BYTES <= len(secret) <= SECRET_MAX_BYTES:
        raise ValueError(f"{key}: {path} holds {len(secret)} bytes; a secret has {SECRET_MIN_BYTES} to "
                         f"{SECRET_MAX_BYTES} (e.g. `openssl rand -hex 32 > {path}`)")
    return secret


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of mutual TLS: this node's certificate and key, and the CA bundle its peers'
    certificates must chain to (the listener requires a client certificate; the dialer checks
    the listener's against the CA, not against the dialled host name: the cluster CA is the
    trust boundary, and peers are dialled by address)."""

    cert_file: str
    key_file: str
    ca_file: str

    def context(self, server: bool) -> ssl.SSLContext:
        """Raises ValueError (naming the key) for a path that is not a regular file, checked
        before OpenSSL opens it (a FIFO would hang that open), and ssl.SSLError for bad PEM."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        for key, path in (("transport.tls_cert_file", self.cert_file), ("transport.tls_key_file", self.key_file)):
            os.close(open_regular(path, key))
        ctx.load_cert_chain(self.cert_file, self.key_file)
        ctx.load_verify_locations(cadata=read_regular(self.ca_file, "transport.tls_ca_file").decode(errors="replace"))
        ctx.verify_mode = ssl.CERT_REQUIRED
        if server:
            # No session tickets: one sent after the handshake would sit unread on the dialer's
            # idle connection, and an idle connection with bytes to read counts as unusable.
            ctx.num_tickets = 0
        else:
            ctx.check_hostname = False
        return ctx


def cert_identity(sock: ssl.SSLSocket) -> str:
    """The peer certificate's subject CN, else its first DNS name ("" if neither)."""
    cert = sock.getpeercert() or {}
    for rdn in cert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return next((v for k, v in cert.get("subjectAltName", ()) if k == "DNS"), "")
