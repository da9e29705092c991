"""The client side of the daemon's arena socket (:mod:`kvstore.daemon.handout`): a session asks
it for the arena's fd (its session id), the session's query channel (``Q``), a watch that ends
the session with this process (``W``), or the HBM pool's handle (``H``). The daemon checks the
session and the caller's uid on every request, and watches the calling process."""

from __future__ import annotations

import json
import os
import socket
import time

import grpc

from kvstore.clients.leases import KVStoreError
from kvstore.tiers.arena import HandoutRefused, recv_fd, recv_header


def handout(path: str, request: bytes, want_fd: bool, timeout_s: float):
    """Ask the daemon's arena socket ``path`` for what ``request`` names: ``(fd or None, size,
    socket)`` (the socket is open: an HBM handle's body follows on it). A busy daemon (a
    connection cap) is asked again, backing off, until ``timeout_s``; a refusal that will not
    change, or one still there at the timeout, raises KVStoreError with the daemon's reason."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(0.05, deadline - time.monotonic()))
            s.connect(path)
            try:
                s.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before it read the request: its reason waits to be read
            fd, size = recv_fd(s) if want_fd else recv_header(s)
            return fd, size, s
        except HandoutRefused as e:
            s.close()
            if not e.retryable:
                raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION, f"arena handout ({path}): {e.reason}") from None
            if time.monotonic() + delay > deadline:
                raise KVStoreError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"arena handout ({path}) still refused after "
                                   f"{timeout_s:g} s: {e.reason}") from None
        except (OSError, ConnectionError) as e:  # no answer at all: a daemon going away, or an old one
            s.close()
            raise KVStoreError(grpc.StatusCode.UNAVAILABLE, f"arena handout ({path}) failed: "
                               f"{getattr(e, 'strerror', None) or e}") from None
        time.sleep(delay)
        delay = min(2 * delay, 0.2)


def hbm_pool(path: str, session_id: bytes, timeout_s: float):
    """The daemon's HBM pool mapped in this process (``kvstore.tiers.hbm.PoolMapping``), asked
    for by session ``session_id``; KVStoreError FAILED_PRECONDITION when the daemon has none."""
    from kvstore.tiers.hbm import open_pool

    try:
        fd, size, s = handout(path, session_id + b"H", False, timeout_s)
    except KVStoreError as e:
        if e.code is not grpc.StatusCode.UNAVAILABLE:
            raise
        raise KVStoreError(grpc.StatusCode.FAILED_PRECONDITION, "the daemon has no HBM tier (hbm.capacity_bytes), "
                           "or this session ended (register again)") from None
    with s:
        body = b""
        while len(body) < size:
            chunk = s.recv(size - len(body))
            if not chunk:
                break
            body += chunk
    handle = json.loads(body)
    if fd is not None and fd >= 0:
        handle["fd"] = fd
    for k in ("handle", "ref_counter_handle", "event_handle"):
        if isinstance(handle.get(k), str):
            handle[k] = bytes.fromhex(handle[k])
    try:
        return open_pool(handle)
    finally:
        if handle.get("fd") is not None:
            os.close(handle["fd"])
