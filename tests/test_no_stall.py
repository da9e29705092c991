"""Nothing can stall the daemon (issue 17, findings 3, 4 and 7): waiting RPCs end when their
client gives up and are bounded per session and in total; idle connections on the arena socket
do not hold up registrations; a signal during the arena's pre-fault stops the daemon at once;
a port conflict is found before the arena is built."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from daemon_util import free_port, start_daemon, stop_all
from kvstore.clients import KVStoreClient
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

LAYOUT = KVLayout(2, 2, 64, "fp16")
BIG_ARENA = "2GiB"  # pre-faults in ~4 s here (first-touch faults at ~0.5 GB/s)


def _stub(sock: str):
    ch = grpc.insecure_channel(f"unix:{sock}")
    return ch, pb_grpc.KVStoreStub(ch)


def _await(stub, sid: bytes, keys: bytes, wait_s: float, timeout_s: float):
    """One AwaitTransfer; returns the status code it ended with (OK for an answer)."""
    try:
        stub.AwaitTransfer(pb.AwaitTransferRequest(session_id=sid, keys=keys, wait_s=wait_s), timeout=timeout_s)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_awaits_whose_client_gave_up_leave_workers_for_stats(tmp_path):
    d = start_daemon(tmp_path, "--server-grpc-workers", "8", "--dram-prefault", "false", transfer="tcp")
    try:
        with KVStoreClient(d.socket_path) as c:
            c.register(LAYOUT, "stall")
            keys = b"".join(c.keys(list(range(32))))
            ch, stub = _stub(d.socket_path)
            with ThreadPoolExecutor(16) as pool:
                t0 = time.monotonic()
                waits = [pool.submit(_await, stub, c.session_id, keys, 300.0, 1.0) for _ in range(16)]
                [w.result() for w in waits]
                gave_up = time.monotonic() - t0
            st = stub.Stats(pb.StatsRequest(), timeout=5.0)  # the waits asked for 300 s
            assert st is not None
            assert gave_up < 30.0  # the clients gave up after 1 s, the waits asked for 300
            ch.close()
    finally:
        stop_all(d)


def test_waits_over_the_bound_are_refused_at_once_and_a_cancelled_wait_frees_its_place(tmp_path):
    d = start_daemon(tmp_path, "--server-grpc-workers", "16", "--server-max-waits-per-session", "2",
                     "--server-max-waits", "3", "--dram-prefault", "false", transfer="tcp")
    try:
        with KVStoreClient(d.socket_path) as a, KVStoreClient(d.socket_path) as b:
            a.register(LAYOUT, "stall")
            b.register(LAYOUT, "stall")
            keys = b"".join(a.keys(list(range(64))))
            ch, stub = _stub(d.socket_path)
            req = lambda s: pb.AwaitTransferRequest(session_id=s, keys=keys, wait_s=30.0)  # noqa: E731
            held = [stub.AwaitTransfer.future(req(a.session_id), timeout=30) for _ in range(2)]
            time.sleep(0.2)  # let them reach the daemon
            t0 = time.monotonic()
            code, msg = _await(stub, a.session_id, keys, 30.0, 30.0)  # a third wait of session a
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "per session" in msg
            held.append(stub.AwaitTransfer.future(req(b.session_id), timeout=30))
            time.sleep(0.2)
            code, msg = _await(stub, b.session_id, keys, 30.0, 30.0)  # the fourth in all
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in all" in msg
            assert time.monotonic() - t0 < 10.0  # refused, not held for the waits' 30 s
            # Other calls still answer, and a cancelled wait gives its place back promptly.
            stub.Stats(pb.StatsRequest(), timeout=2.0)
            held[0].cancel()
            deadline = time.monotonic() + 2.0
            while True:
                code, _ = _await(stub, a.session_id, keys, 0.05, 5.0)
                if code == grpc.StatusCode.OK or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert code == grpc.StatusCode.OK
            for f in held[1:]:
                f.cancel()
            ch.close()
    finally:
        stop_all(d)


def _arena_conns(path: str, n: int) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        out.append(s)
    return out


def _answer(s: socket.socket, timeout_s: float) -> bytes:
    """What the daemon sent before it closed ``s`` (TimeoutError if it did not close in time)."""
    s.settimeout(timeout_s)
    got = b""
    while piece := s.recv(4096):
        got += piece
    return got


def _still_open(s: socket.socket) -> bool:
    """True while the daemon has neither written to nor closed ``s``."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    finally:
        s.setblocking(True)


def test_idle_arena_connections_do_not_block_a_registration(tmp_path):
    # The idle connections are held for 6 s; a registration that queued behind them would find
    # them already dropped. No wall-clock bound: the proof is that they are still pending.
    d = start_daemon(tmp_path, "--dram-prefault", "false", "--server-handout-timeout-s", "6")
    idle = _arena_conns(d.socket_path + ".arena", 6)  # under the per-user cap (8)
    try:
        with KVStoreClient(d.socket_path) as c:
            c.register(LAYOUT, "stall")  # maps the arena through the handout
            assert c.arena is not None
        assert all(_still_open(s) for s in idle), "the registration waited for idle connections"
        for s in idle:  # each idle connection is dropped at its deadline, told why
            assert b"no request within server.handout_timeout_s" in _answer(s, 15.0)
    finally:
        for s in idle:
            s.close()
        stop_all(d)


def test_a_user_over_the_handout_cap_is_turned_away_at_once(tmp_path):
    d = start_daemon(tmp_path, "--dram-prefault", "false", "--server-handout-per-user", "2",
                     "--server-handout-timeout-s", "5")
    idle = _arena_conns(d.socket_path + ".arena", 2)
    try:
        time.sleep(0.2)
        (extra,) = _arena_conns(d.socket_path + ".arena", 1)
        # Closed without waiting for the request, saying why.
        assert b"server.handout_per_user" in _answer(extra, 1.0)
        extra.close()
        for s in idle:
            s.close()
        with KVStoreClient(d.socket_path) as c:  # the places come back once the idle connections close
            c.register(LAYOUT, "stall")
        assert "arena handout: uid" in d.log()
    finally:
        stop_all(d)


def _serve(tmp_path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", str(tmp_path / "k.sock"),
                             "--dram-capacity-bytes", BIG_ARENA, "--dram-extent-bytes", "4MiB", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _enough_memory() -> bool:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 > 3 * (2 << 30)
    return False


@pytest.mark.skipif(not _enough_memory(), reason=f"needs free memory for a {BIG_ARENA} arena")
def test_sigterm_during_prefault_stops_the_daemon_promptly(tmp_path):
    p = _serve(tmp_path, "--metrics-port", "0")
    try:
        line = ""
        while "creating" not in line:  # the pre-fault starts right after this line
            line = p.stdout.readline()
            assert line, "daemon exited before building its arena"
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(10)
        took = time.monotonic() - t0
        out = p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert took < 2.0, f"SIGTERM took {took:.1f} s to stop a pre-faulting daemon:\n{out}"
    assert rc == 0, out
    assert "pre-fault" in out
    assert not (tmp_path / "k.sock").exists() and not (tmp_path / "k.sock.arena").exists()


@pytest.mark.parametrize("what", ["metrics", "transport", "server"])
def test_a_port_conflict_is_found_before_the_arena_and_exits_2(tmp_path, what):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        args = {"metrics": ["--metrics-port", str(port)],
                "transport": ["--metrics-port", "0", "--transport-listen", f"127.0.0.1:{port}"],
                "server": ["--metrics-port", "0", "--server-tcp-listen", f"127.0.0.1:{port}",  # the TLS listener
                           "--server-tls-cert-file", str(tmp_path / "c.pem"), "--server-tls-key-file",
                           str(tmp_path / "k.pem")]}[what]
        p = _serve(tmp_path, *args)
        out, _ = p.communicate(timeout=30)
    finally:
        taken.close()
    assert p.returncode == 2, out
    assert f"{what}." in out and "in use" in out, out
    assert "creating" not in out  # found before the arena was built
    assert not (tmp_path / "k.sock").exists()


def test_a_socket_conflict_exits_2_like_a_port_conflict(tmp_path):
    d = start_daemon(tmp_path, "--dram-prefault", "false")
    try:
        p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", d.socket_path,
                            "--dram-capacity-bytes", "64MiB", "--dram-extent-bytes", "4MiB", "--metrics-port",
                            str(free_port())], capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, p.stderr
        assert "another daemon is serving" in p.stderr
        assert d.alive() and os.path.exists(d.socket_path)
    finally:
        stop_all(d)


def test_the_wait_bounds_must_leave_a_worker_free():
    from kvstore import config as C

    assert C.load(env={}, overrides={"server.grpc_workers": "8"}).server.resolved_max_waits() == 4
    with pytest.raises(C.ConfigError, match="server.max_waits"):
        C.load(env={}, overrides={"server.grpc_workers": "8", "server.max_waits": "8"})
    with pytest.raises(C.ConfigError, match="server.handout_timeout_s"):
        C.load(env={}, overrides={"server.handout_timeout_s": "0"})


def test_prefetch_waits_whose_client_gave_up_leave_workers_for_stats(tmp_path):
    """PrefetchStatus waits for blocks that cannot reach DRAM (every slot is reserved): with its
    client gone after 1 s, each ends then, not at the prefetch's 30 s deadline."""
    import numpy as np

    lay = KVLayout(8, 4, 128, "fp16", "mha")  # 256 KiB blocks: 128 fill the 32 MiB tier
    d = start_daemon(tmp_path, "--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "128MiB",
                     "--nvme-file-bytes", "64MiB", "--nvme-durable-commit", "true", "--server-grpc-workers", "4",
                     "--dram-prefault", "false", dram="32MiB")
    try:
        with KVStoreClient(d.socket_path) as c:
            c.register(lay, "stall")
            toks = list(range(8 * 16))
            c.put(toks, np.zeros(lay.tensor_shape(len(toks)), np.float16))  # on NVMe too (durable)
            lease = c.reserve(c.keys(list(range(10**6, 10**6 + 128 * 16))))  # every DRAM slot: toks leave DRAM
            handle = c.prefetch(c.keys(toks), deadline_s=30)
            ch, stub = _stub(d.socket_path)

            def status(_):
                try:
                    stub.PrefetchStatus(pb.PrefetchStatusRequest(session_id=c.session_id, handle=handle, wait_s=30),
                                        timeout=1.0)
                except grpc.RpcError as e:
                    return e.code()

            with ThreadPoolExecutor(8) as pool:
                codes = list(pool.map(status, range(8)))
            stub.Stats(pb.StatsRequest(), timeout=5.0)  # answers while the statuses wait 30 s
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes  # 2 of 4 workers may wait
            lease.abort()
            ch.close()
    finally:
        stop_all(d)
