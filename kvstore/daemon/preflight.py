"""What ``kvstore serve`` checks before it builds anything: directories no other user can plant
files in, a socket path that is free (a stale socket of a dead daemon is removed), ports no
other process holds. Each failure is a :class:`StartupError` whose message says what to change."""

from __future__ import annotations

import os
import socket
import stat


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to change. ``kvstore serve``
    exits 2, as for a config error: something must change before it can start."""

    exit_code = 2


class PreconditionError(StartupError):
    """What the daemon was given cannot be used as it is (a path in the way, a directory others
    could write into); like a config error, ``kvstore serve`` exits 2."""

    exit_code = 2


def check_own_dir(d: str, key: str) -> None:
    """Refuse a directory another user could plant or swap files in: one owned by another user,
    or writable by group or others (a sticky /tmp included: names in it can be taken first)."""
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise PreconditionError(f"{key}: {d} is not a directory")
    if st.st_uid != os.getuid():
        raise PreconditionError(f"{key}: directory {d} belongs to uid {st.st_uid}, not to this daemon's user "
                                f"(uid {os.getuid()}); chown it or choose another path")
    who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
    if who:
        raise PreconditionError(f"{key}: directory {d} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}); "
                                f"chmod go-w {d} (e.g. 0700, or 0750 to share the socket with a group) "
                                "or choose another path")


def check_data_dir(d: str) -> None:
    """nvme.dir, when it exists already (else the tier creates it 0700; a path it cannot create
    leaves the daemon serving from DRAM, as any NVMe failure does)."""
    if os.path.isdir(d):
        check_own_dir(d, "nvme.dir")


def prepare_socket_path(path: str) -> None:
    d = os.path.dirname(path) or "."
    if not os.path.isdir(d):
        old_umask = os.umask(0o077)  # parents too: 0700 whatever the umask (start-up is single-threaded)
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
        finally:
            os.umask(old_umask)
    check_own_dir(d, "server.socket_path")
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise PreconditionError(f"server.socket_path: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        else:
            raise PreconditionError(f"server.socket_path: another daemon is serving on {path}")
        finally:
            probe.close()


def check_port_free(key: str, host: str, port: int, what: str) -> None:
    """Bind ``host:port`` for a moment: a port another process holds is found before the arena
    is built (minutes of pre-fault on a large node) rather than after. The listener itself binds
    later; a port taken in between is still reported, then."""
    if not port:
        return
    host = host.strip("[]")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do
            probe.bind(addr)
    except OSError as e:
        raise StartupError(f"{key}: cannot {what} on {host}:{port}: {e.strerror or e}") from None


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")  # config validation checked the shape
    return host, int(port)
