"""Sessions end: a client that closes releases its session and leases at once; one that is
killed, within the session TTL; an idle live one keeps its session by keep-alive; re-registering
leaves one session; an expired session is NOT_FOUND, and the client registers again by itself
for calls that name no lease. Against the real daemon process and the real CLI; the core's
expiry order with an injected clock is in test_core.py."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from kvstore import config as C
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from wait_util import wait_for

LAYOUT = KVLayout(4, 2, 64, "fp16")
TOKENS = list(range(4 * 16))  # 4 full blocks
TTL_S = 2.0      # the session TTL of the daemons started here
REAPER_S = 0.1
SLACK_S = 8.0    # scheduling on a loaded 2-core machine, on top of TTL + reaper interval


def _kv(tokens: int = len(TOKENS)):
    return np.random.default_rng(0).standard_normal(LAYOUT.tensor_shape(tokens)).astype(np.float16)


@pytest.fixture
def short_ttl_daemon(daemons):
    # The lease TTL stays at its default (30 s): only the end of the session can free them here.
    return daemons("--server-session-ttl-s", str(TTL_S), "--server-reaper-interval-s", str(REAPER_S))


def counters(c: KVStoreClient) -> dict:
    return dict(c.stats().counters)


def ns_sessions(c: KVStoreClient) -> int:
    return sum(ns.sessions for ns in c.stats().namespaces)


def scraped(d, name: str) -> float:
    """The value of an unlabelled series on the daemon's /metrics."""
    text = urllib.request.urlopen(d.metrics_url, timeout=5).read().decode()
    (value,) = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


def cli(sock: str, *args) -> object:
    out = subprocess.run([sys.executable, "-m", "kvstore", *args, "--socket", sock, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --- the real daemon ----------------------------------------------------------------------------

def test_close_frees_the_session_and_its_leases_at_once(daemon, client_factory):
    other = client_factory(LAYOUT)        # same namespace: it outlives the one that closes
    base = counters(other)
    c = client_factory(LAYOUT)
    c.put(TOKENS, _kv())
    keys = c.keys(TOKENS)
    c.delete(keys[3:])                    # block 3 free again, to reserve and never commit
    c.reserve(keys[3:], parent=keys[2]).view(0)[:] = 1
    c.acquire(keys[:1])                   # a pin
    assert other.delete(keys[:1]) == 0    # pinned: refused as busy
    before = c.stats()
    assert before.counters["sessions"] == base["sessions"] + 1 and before.counters["leases"] == 2
    assert before.tiers[0].blocks == 4 and ns_sessions(other) == 2
    c.close()
    after = counters(other)               # no wait: CloseSession ran inside close()
    assert after["sessions"] == base["sessions"] and after["leases"] == 0
    assert after["kvstore_session_ends_total"] == base["kvstore_session_ends_total"] + 1
    assert ns_sessions(other) == 1
    assert other.stats().tiers[0].blocks == 3          # the reserved slot is freed
    assert other.delete(keys[:1]) == 1                 # the pinned block is evictable again


def _hold_leases_and_wait(sock: str, ready, report) -> None:
    c = KVStoreClient(sock)
    c.register(LAYOUT, "test-model")
    keys = c.keys(TOKENS)
    c.put(TOKENS[:3 * 16], _kv(3 * 16))
    c.reserve(keys[3:], parent=keys[2]).view(0)[:] = 1  # write reservation, never committed
    c.acquire(keys[:1])                                  # read pin, never released
    report.put(c.session_id)
    ready.set()
    time.sleep(600)


def test_sigkilled_client_releases_session_and_leases_at_its_exit(daemons):
    # The TTLs are ten minutes: only the daemon's watch on the client's process can end it here.
    d = daemons("--server-session-ttl-s", "600", "--server-lease-ttl-s", "600")
    ctx = mp.get_context("spawn")
    ready, report = ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_hold_leases_and_wait, args=(d.socket_path, ready, report))
    p.start()
    assert ready.wait(60)
    sid = report.get(timeout=10)
    obs = KVStoreClient(d.socket_path)                # Stats only: no session of its own
    st = obs.stats()
    assert st.counters["sessions"] == 1 and st.counters["leases"] == 2 and st.tiers[0].blocks == 4
    assert scraped(d, "kvstore_sessions") == 1
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    killed = time.monotonic()
    wait_for(lambda: counters(obs)["sessions"] == 0, SLACK_S, "the dead client's session to end")
    print(f"session ended {time.monotonic() - killed:.3f} s after the SIGKILLed client was reaped")
    wait_for(lambda: scraped(d, "kvstore_sessions") == 0, 15, "the sessions gauge to follow")  # the reaper's next step
    js = cli(d.socket_path, "stats")
    assert js["counters"]["sessions"] == 0 and js["counters"]["leases"] == 0
    assert js["counters"]["kvstore_session_ends_total"] == 1
    assert js["counters"]["kvstore_lease_expiries_total"] == 0  # they went with the session, not their TTL
    assert js["tiers"][0]["blocks"] == "3"                     # the reserved slot is freed
    assert [ns["sessions"] for ns in cli(d.socket_path, "ls")] == [0]
    with pytest.raises(KVStoreError) as e:
        obs.call("Lookup", pb.LookupRequest(session_id=sid, keys=b""))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.refusal == pb.REFUSAL_SESSION_UNKNOWN
    assert "process exited" in e.value.message
    assert "kvstore.daemon.sessions" in d.log() and f"process {p.pid} exited: 1 session(s) ended, 2 lease(s)" in d.log()
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "test-model")
    keys = c.keys(TOKENS)
    assert c.lookup(TOKENS) == 3 * 16                  # committed blocks outlive their writer
    assert c.delete(keys[:1]) == 1                     # the pin is gone: evictable again
    c.close()
    obs.close()


def test_an_idle_live_client_keeps_its_session_past_several_ttls(short_ttl_daemon):
    d = short_ttl_daemon
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "test-model")
    c.put(TOKENS, _kv())
    sid = c.session_id
    obs = KVStoreClient(d.socket_path)
    # Idle for three TTLs (idleness is the point: no clock to inject into two processes);
    # only the client's keep-alive thread talks to the daemon meanwhile.
    for _ in range(12):
        time.sleep(TTL_S / 4)
        assert counters(obs)["sessions"] == 1
    assert c.lookup(TOKENS) == len(TOKENS) and c.session_id == sid  # no new registration
    assert counters(obs)["kvstore_session_ends_total"] == 0
    c.close()
    assert counters(obs)["sessions"] == 0
    obs.close()


def test_register_again_closes_the_old_session(daemon, client_factory):
    other = client_factory(LAYOUT)
    base = counters(other)
    c = client_factory(LAYOUT)
    c.put(TOKENS, _kv())
    arena = c.arena
    c.acquire(c.keys(TOKENS)[:2])            # a pin that the next register ends
    for _ in range(50):
        c.register(LAYOUT, "test-model")
    after = counters(other)
    assert after["sessions"] == base["sessions"] + 1 and after["leases"] == 0
    assert after["kvstore_session_ends_total"] == base["kvstore_session_ends_total"] + 50
    assert ns_sessions(other) == 2
    assert c.arena is arena                   # same daemon, same arena: the mapping is kept
    assert c.lookup(TOKENS) == len(TOKENS)


def _expire_while_stopped(sock: str, ready, go, report) -> None:
    c = KVStoreClient(sock)
    c.register(LAYOUT, "test-model")
    c.put(TOKENS[:2 * 16], _kv(2 * 16))
    keys = c.keys(TOKENS)
    w = c.reserve(keys[2:], parent=keys[1])
    old = c.session_id
    report.put(old)
    ready.set()
    go.wait()                                # SIGSTOPped meanwhile, past the TTL
    try:
        w.commit()                           # names a lease: not sent again, the lease is gone
        commit = ("ok", 0)
    except KVStoreError as e:
        commit = (e.code.name, e.refusal)
    hits = c.lookup(TOKENS)                  # names only the session: registers again, sent again
    report.put((commit, hits, c.session_id != old, len(c.session_id)))
    c.close()


def test_expired_session_is_not_found_and_the_client_registers_again(short_ttl_daemon):
    d = short_ttl_daemon
    ctx = mp.get_context("spawn")
    ready, go, report = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_expire_while_stopped, args=(d.socket_path, ready, go, report))
    p.start()
    assert ready.wait(60)
    old = report.get(timeout=10)
    obs = KVStoreClient(d.socket_path)
    os.kill(p.pid, signal.SIGSTOP)       # a process that stops (debugger, swap storm): no keep-alive
    try:
        wait_for(lambda: counters(obs)["sessions"] == 0, TTL_S + REAPER_S + SLACK_S,
                 "the stopped client's session to expire")
        assert counters(obs)["leases"] == 0
    finally:
        os.kill(p.pid, signal.SIGCONT)
    go.set()
    commit, hits, renewed, sid_len = report.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    assert commit == ("NOT_FOUND", pb.REFUSAL_SESSION_UNKNOWN)
    assert hits == 2 * 16 and renewed and sid_len == 16
    c = counters(obs)
    assert c["sessions"] == 0 and c["kvstore_session_ends_total"] == 2  # expired, then closed
    with pytest.raises(KVStoreError) as e:
        obs.call("KeepAlive", pb.KeepAliveRequest(session_id=old))
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "expired" in e.value.message
    obs.close()


def test_a_call_while_the_daemon_was_away_does_not_fail_the_first_after_its_restart(tmp_path):
    """A call made while the daemon restarts (the session's keep-alive, as its thread sends
    them) fails to connect, and gRPC would then fail every call at once until its reconnect
    backoff ends (1 s and growing) though the daemon is back: the first Lookup after the
    restart must register again and be answered. While the daemon is down, calls still fail
    at once: nothing waits for a daemon that is not there."""
    from daemon_util import start_daemon

    d = start_daemon(tmp_path)
    c = KVStoreClient(d.socket_path, query_channel=False)  # every call over gRPC
    c.register(LAYOUT, "away")
    c.put(TOKENS, _kv())
    assert d.stop() == 0
    t = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        c.stub.KeepAlive(pb.KeepAliveRequest(session_id=c.session_id), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(KVStoreError) as e:
        c.lookup(TOKENS)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t < 2.0
    d = start_daemon(tmp_path)
    try:
        for _ in range(3):  # the first call after the restart, then two more
            assert c.lookup(TOKENS) == 0  # answered by the new daemon (it holds nothing), no error
        assert counters(c)["sessions"] == 1
        c.close()
    finally:
        assert d.stop() == 0


class NotConnected(grpc.RpcError):
    """What gRPC raises for a call it never sent: no connection to the daemon."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "failed to connect to all addresses; last error: UNAVAILABLE: (injected)"


class CountingStub:
    """The client's stub, counting each method's calls (and their keyword arguments); the first
    ``fail_first`` call of each method raises :class:`NotConnected` instead."""

    def __init__(self, stub, fail_first: int = 0) -> None:
        self._stub, self.fail_first, self.calls = stub, fail_first, {}

    def __getattr__(self, name):
        real = getattr(self._stub, name)

        def call(request, **kw):
            self.calls.setdefault(name, []).append(kw)
            if len(self.calls[name]) <= self.fail_first:
                raise NotConnected()
            return real(request, **kw)
        return call


def test_a_call_never_sent_is_sent_again_once_the_daemon_listens_and_no_other_is(daemons):
    """gRPC's "failed to connect" with the daemon's socket accepting: sent once more, waiting for
    the connection. An UNAVAILABLE the daemon sends itself (a Prefetch with no lower tier) keeps
    its message and is sent once; with no daemon listening, the call fails at once."""
    d = daemons()
    c = KVStoreClient(d.socket_path, query_channel=False)
    c.register(LAYOUT, "never-sent")
    c.put(TOKENS, _kv())
    c.stub = stub = CountingStub(c.stub, fail_first=1)
    assert c.lookup(TOKENS) == len(TOKENS)
    assert stub.calls["Lookup"] == [{"timeout": c.timeout_s}, {"timeout": c.timeout_s, "wait_for_ready": True}]
    c.stub = stub = CountingStub(stub._stub)
    with pytest.raises(KVStoreError) as e:
        c.prefetch(c.keys(TOKENS))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no lower tier" in e.value.message
    assert len(stub.calls["Prefetch"]) == 1
    c.stub = stub = CountingStub(stub._stub, fail_first=1)
    d.stop()
    with pytest.raises(KVStoreError) as e:
        c.lookup(TOKENS)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and len(stub.calls["Lookup"]) == 1
    c.close(end_session=False)


def test_a_worker_that_exits_without_close_ends_its_session(daemon, client_factory):
    obs = client_factory(LAYOUT)
    base = counters(obs)["sessions"]
    obs.put(TOKENS, _kv())
    code = ("import sys\nfrom kvstore.clients import KVStoreClient\nfrom kvstore.layout import KVLayout\n"
            "c = KVStoreClient(sys.argv[1])\nc.register(KVLayout(4, 2, 64, 'fp16'), 'test-model')\n"
            "lease = c.acquire(c.keys(list(range(64))))\nprint(lease.count)\n")  # pinned at exit
    out = subprocess.run([sys.executable, "-c", code, daemon.socket_path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "4", out.stderr
    # The session TTL is 60 s and the lease TTL 30 s: both go at the process's exit, long before.
    wait_for(lambda: counters(obs)["sessions"] == base, 10, "the exited worker's session to end")
    c = counters(obs)
    assert c["leases"] == 0 and c["kvstore_session_ends_total"] == 1


def test_close_session_bad_input(daemon, client_factory):
    c = client_factory(LAYOUT)
    c.put(TOKENS, _kv())

    def close(sid):
        with pytest.raises(KVStoreError) as e:
            c.call("CloseSession", pb.CloseSessionRequest(session_id=sid))
        return e.value

    e = close(b"short")
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "session_id" in e.message and "16 bytes" in e.message
    e = close(b"")
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT
    e = close(b"x" * 16)
    assert e.code == grpc.StatusCode.NOT_FOUND and "unknown session" in e.message and "Register" in e.message
    gone = KVStoreClient(daemon.socket_path)
    gone.register(LAYOUT, "test-model")
    sid = gone.session_id
    gone.close()
    gone.close()                                  # twice: nothing left to do, no error
    e = close(sid)
    assert e.code == grpc.StatusCode.NOT_FOUND and "closed by its client" in e.message
    assert e.refusal == pb.REFUSAL_SESSION_UNKNOWN
    assert daemon.alive() and c.lookup(TOKENS) == len(TOKENS)  # still serving, nothing lost


def test_session_ttl_is_validated_and_changes_live(tmp_path, daemons):
    with pytest.raises(C.ConfigError, match=r"^server\.session_ttl_s: must be in \[1, 86400\] seconds"):
        C.load(env={}, overrides={"server.session_ttl_s": "0.5"})
    assert C.load(env={"KVSTORE_SERVER_SESSION_TTL_S": "7"}).server.session_ttl_s == 7.0
    cfg = tmp_path / "k.toml"
    cfg.write_text("[server]\nsession_ttl_s = 60\n")
    d = daemons("--config", str(cfg))
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "test-model")
    assert c.info.session_ttl_s == 60
    cfg.write_text("[server]\nsession_ttl_s = 5\n")
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reloaded config" in d.log(), 10, "the reload")
    assert "server.session_ttl_s" in d.log().split("reloaded config")[1].split("need a restart")[0]
    # The running client learns it from its next keep-alive; a new session from Register.
    assert c.call("KeepAlive", pb.KeepAliveRequest(session_id=c.session_id)).session_ttl_s == 5
    c.register(LAYOUT, "test-model")
    assert c.info.session_ttl_s == 5
    c.close()
