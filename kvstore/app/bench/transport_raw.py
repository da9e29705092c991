"""Same-run raw references for ``kvstore bench transfer``: what the machine gives without our
protocol (no frames, no checksums, no sink), measured the same way as the transport.

* raw TCP: ``sendall`` of each message, ``recv_into(..., MSG_WAITALL)`` into one buffer;
* raw ucxx: tagged send/recv on the low-level ucxx API, blocking progress, receives posted ahead;
* ``ucx_perftest -t tag_bw`` from the libucx wheel, when its binary is there.

``verify``: the receiver also takes the xxh3 of every message as the transport's receiver does
(TCP: tcp.recv_hashed, in 512 KiB pieces as they arrive; UCX: each message once it has landed),
so what the integrity check alone costs is measured apart from what the transport adds.

Throughput: ``n`` messages back to back, bytes / (first send .. receiver's last arrival). The
memory touched matches the transport benchmark (4 source buffers, a receive ring of the sink's
size), so cache effects do not favour either side.
Latency: paced, one message in flight; receiver's arrival minus sender's submit, both on
CLOCK_MONOTONIC (one host). CPU: each process's CPU time (all its threads) over the timed
stream, per GB moved: when both sides are near one core's worth per second, the run is CPU-bound
and what the transport adds per byte sets the ratio. The raw functions return ``{"gbps",
"lat_p50_us", "lat_p99_us", "cpu_tx_s_per_gb", "cpu_rx_s_per_gb"}``;
``perftest`` returns ``{"gbps", "overhead_p50_us"}`` and varies a lot between runs below 16 MiB
here, so raw ucxx is the reference the ratios are judged against.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import socket
import subprocess
import sys
import time

import numpy as np

from kvstore.transport import ucx_env
from kvstore.transport.protocol import checksum


def percentiles(samples_s: list[float]) -> tuple[float, float]:
    """(p50, p99) of samples in seconds, returned in microseconds."""
    if not samples_s:
        return float("nan"), float("nan")
    a = np.asarray(samples_s) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _result(nbytes: int, seconds: float, lat: list[float], cpu_tx_s: float, cpu_rx_s: float) -> dict:
    p50, p99 = percentiles(lat)
    gb = nbytes / 1e9
    return {"gbps": gb / seconds, "lat_p50_us": p50, "lat_p99_us": p99,
            "cpu_tx_s_per_gb": cpu_tx_s / gb, "cpu_rx_s_per_gb": cpu_rx_s / gb}


def _mark() -> tuple[float, float]:
    """(CLOCK_MONOTONIC, this process's CPU seconds): what a receiver reports at each mark."""
    return time.monotonic(), time.process_time()


# -- raw TCP -------------------------------------------------------------------------------------

_WARM = 8  # untimed messages first: connection ramp-up, page faults, UCX wireup
SOURCES = 4  # distinct source buffers the sender cycles through (as bench.py does)


def _memory(nbytes: int, shared: bool) -> np.ndarray:
    """``nbytes`` of memory, every page touched. ``shared``: shared memory, as a daemon's DRAM
    arena is (it is handed to its workers), madvised for huge pages as the arena is; they come
    only where shmem_enabled allows (advise/always). Else private memory, which numpy asks
    huge pages for and gets wherever THP is enabled=madvise or always: on this VM's shmem
    setting (never) copies through it ran about 20% faster (raw ucxx, 4 MiB, same run)."""
    if not shared:
        return np.full(nbytes, 7, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError, AttributeError):
        pass
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 7
    return a


def _ring(ring_bytes: int, size: int, shared: bool = False) -> list[memoryview]:
    """Receive slots cycling through ``ring_bytes``, faulted in: the same memory footprint as
    the transport benchmark's sink, so neither side gets to stay in cache and the other not."""
    ring = _memory(max(ring_bytes, size), shared)
    return [memoryview(ring[i * size:(i + 1) * size]) for i in range(ring.nbytes // size)]


def _tcp_rx(conn, size: int, n: int, n_lat: int, ring_bytes: int, shared: bool = False,
            verify: bool = False) -> None:
    from kvstore.transport.tcp import recv_hashed

    ls = socket.create_server(("127.0.0.1", 0))
    conn.send(ls.getsockname()[1])
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    slots = _ring(ring_bytes, size, shared)
    for i in range(_WARM + n + n_lat):
        buf = slots[i % len(slots)]
        if verify:  # as the transport's receiver does
            recv_hashed(s, buf, None)
        else:
            got = 0
            while got < size:
                got += s.recv_into(buf[got:], size - got, socket.MSG_WAITALL) or _eof()
        if i == _WARM - 1 or i == _WARM + n - 1 or i >= _WARM + n:
            conn.send(_mark())
    s.close()


def _eof() -> int:
    raise ConnectionError("raw TCP sender went away")


def _sources(size: int, footprint: int = 0, shared: bool = False) -> list[memoryview]:
    """Distinct source buffers the sender cycles through: ``SOURCES`` of them, as the transport
    benchmark's sender does, or as many as cover ``footprint`` bytes. A sender measured against
    a daemon, which reads each block from its DRAM arena once, passes the transfer's size: 4
    sources of 4 MiB stay in this host's 32 MiB L3, the daemon's blocks do not."""
    n = max(SOURCES, footprint // size)
    whole = _memory(n * size, shared)  # one allocation, every page touched
    return [memoryview(whole[i * size:(i + 1) * size]) for i in range(n)]


def raw_tcp(ctx, size: int, n: int, n_lat: int, ring_bytes: int = 64 << 20, src_bytes: int = 0,
            shared: bool = False, verify: bool = False) -> dict:
    """``shared``: send from and receive into shared memory, as a daemon does (:func:`_memory`)."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_tcp_rx, args=(child, size, n, n_lat, ring_bytes, shared, verify), daemon=True)
    p.start()
    try:
        s = socket.create_connection(("127.0.0.1", parent.recv()))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        src = _sources(size, src_bytes, shared)
        for i in range(_WARM):
            s.sendall(src[i % len(src)])
        _, rx0 = parent.recv()
        t0, tx0 = _mark()
        for i in range(n):
            s.sendall(src[i % len(src)])
        t1, rx1 = parent.recv()
        seconds, tx_cpu = t1 - t0, time.process_time() - tx0
        lat = []
        for i in range(n_lat):
            t = time.monotonic()
            s.sendall(src[i % len(src)])
            lat.append(parent.recv()[0] - t)
        s.close()
        return _result(size * n, seconds, lat, tx_cpu, rx1 - rx0)
    finally:
        p.join(timeout=10)
        p.kill()


# -- raw ucxx ------------------------------------------------------------------------------------

def _wait(worker, reqs) -> None:
    while not all(r.completed for r in reqs):
        worker.progress_worker_event(100)
    for r in reqs:
        r.check_error()


def _ucx_rx(conn, size: int, n: int, n_lat: int, depth: int, ring_bytes: int, shared: bool = False,
            verify: bool = False) -> None:
    api, Array = ucx_env.load()
    ctx = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
    w = api.UCXWorker(ctx)
    w.init_blocking_progress_mode()
    eps: list = []
    lst = api.UCXListener.create(worker=w, port=0, cb_func=lambda cr: eps.append(
        lst.create_endpoint_from_conn_request(cr, True)))
    conn.send(lst.port)
    while not eps:
        w.progress_worker_event(100)
    ep = eps[0]
    slots = _ring(ring_bytes, size, shared)
    ring = [Array(m) for m in slots]
    depth = min(depth, len(ring))
    tag = api.UCXXTag(1)
    for count in (_WARM, n):
        posted = [ep.tag_recv(ring[i % len(ring)], tag) for i in range(min(depth, count))]
        for i in range(count):  # keep `depth` receives posted ahead, like the transport's receiver
            _wait(w, [posted[0]])
            posted.pop(0)
            if i + depth < count:
                posted.append(ep.tag_recv(ring[(i + depth) % len(ring)], tag))
            if verify:  # as the transport's receiver does inline: once the whole message landed
                checksum(slots[i % len(slots)])
        conn.send(_mark())
    for _ in range(n_lat):
        _wait(w, [ep.tag_recv(ring[0], tag)])
        conn.send(_mark())
    conn.recv()  # hold the endpoint until the sender is done


def raw_ucxx(ctx, size: int, n: int, n_lat: int, ring_bytes: int = 64 << 20, depth: int = 4,
             src_bytes: int = 0, shared: bool = False, verify: bool = False) -> dict:
    api, Array = ucx_env.load()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_ucx_rx, args=(child, size, n, n_lat, depth, ring_bytes, shared, verify), daemon=True)
    p.start()
    try:
        uctx = api.UCXContext(feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
        w = api.UCXWorker(uctx)
        w.init_blocking_progress_mode()
        ep = api.UCXEndpoint.create(w, "127.0.0.1", parent.recv(), True)
        src, tag = [Array(m) for m in _sources(size, src_bytes, shared)], api.UCXXTag(1)
        data = src[0]
        rx0 = 0.0
        for count in (_WARM, n):
            t0, tx0 = _mark()
            reqs = []
            for i in range(count):
                reqs.append(ep.tag_send(src[i % len(src)], tag))
                if len(reqs) >= depth:
                    _wait(w, [reqs.pop(0)])
            _wait(w, reqs)
            while not parent.poll():
                w.progress_worker_event(10)
            t1, rx1 = parent.recv()
            seconds, tx_cpu, rx_cpu, rx0 = t1 - t0, time.process_time() - tx0, rx1 - rx0, rx1
        lat = []
        for _ in range(n_lat):
            t = time.monotonic()
            req = ep.tag_send(data, tag)
            while not parent.poll():
                w.progress_worker_event(1)
            lat.append(parent.recv()[0] - t)
            _wait(w, [req])
        parent.send("done")
        ep.close_blocking()
        return _result(size * n, seconds, lat, tx_cpu, rx_cpu)
    finally:
        p.join(timeout=10)
        p.kill()


# -- ucx_perftest --------------------------------------------------------------------------------

def perftest_binary() -> str | None:
    """Path of ``ucx_perftest`` shipped in the libucx wheel, if any."""
    try:
        import libucx
    except ImportError:
        return None
    hits = glob.glob(os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_perftest"))
    return hits[0] if hits else None


def perftest(size: int, n: int, port: int = 0) -> dict | None:
    """``ucx_perftest -t tag_bw -e`` (error handling on, as the transport runs) over loopback.
    Busy-polls (perftest's default), so it is an upper bound for blocking progress."""
    binary = perftest_binary()
    if binary is None:
        return None
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(os.path.dirname(binary)), "lib"),
               **{k: os.environ.get(k, v) for k, v in ucx_env.UCX_DEFAULTS.items()})
    port = port or 20000 + os.getpid() % 20000
    srv = subprocess.Popen([binary, "-p", str(port), "-e"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.1)
            cli = subprocess.run([binary, "127.0.0.1", "-p", str(port), "-e", "-t", "tag_bw", "-s", str(size),
                                  "-n", str(n)], env=env, capture_output=True, text=True, timeout=120)
            m = re.search(r"^Final:\s+(.*)$", cli.stdout, re.M)
            if m:
                cols = m.group(1).split()  # iters, lat 50%, avg, overall (us), bw avg, overall (MB/s), ...
                # perftest's "latency" columns in bandwidth mode are per-message posting overhead
                return {"gbps": float(cols[5]) * 2**20 / 1e9, "overhead_p50_us": float(cols[1])}
            if "Connection refused" not in cli.stderr + cli.stdout:
                sys.stderr.write(cli.stderr[-500:])
                return None
        return None
    finally:
        srv.kill()
        srv.wait()
