"""Benchmarks behind ``kvstore bench``: each measures a path against a raw reference in the same run."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def start_daemon(workdir: str, name: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """Run ``kvstore serve`` with a socket in ``workdir`` and ``flags``; wait (120 s at most) until
    it answers Stats. Returns ``(process, socket path)``; the log is ``workdir/<name>.log``."""
    from kvstore.clients.client import KVStoreClient

    sock = os.path.join(workdir, f"{name}.sock")
    log = open(os.path.join(workdir, f"{name}.log"), "wb")
    p = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", sock,
                          "--metrics-port", "0", *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise SystemExit(f"bench: daemon {name} exited with {p.returncode}; see {log.name}")
        if os.path.exists(sock):
            try:
                KVStoreClient(sock, timeout_s=1).stats()
                return p, sock
            except Exception:  # noqa: BLE001 - not serving yet
                pass
        time.sleep(0.1)
    p.kill()
    raise SystemExit(f"bench: daemon {name} did not start within 120 s")
