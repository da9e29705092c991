"""Query channels (kvstore.daemon.query_channel): a session's Lookups and Acquires over its own
unix connection, with the real daemon process. The answers are gRPC's, refusals included; the
channel is bound to its session; a bad frame closes that channel alone; a restarted daemon is
met the way gRPC meets it."""

import os
import socket
import threading

import grpc
import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient
from kvstore.clients.leases import KVStoreError
from kvstore.daemon.query_channel import FRAME, METHOD_IDS, QueryChannels
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb

LAYOUT = KVLayout(2, 2, 32, "fp16", "gqa", block_tokens=16)


class NoLookupsOverGrpc:
    """A stub whose Lookup and Acquire fail the test: only the channel may answer them."""

    def __init__(self, stub) -> None:
        self._stub = stub

    def __getattr__(self, name):
        if name in ("Lookup", "Acquire"):
            raise AssertionError(f"{name} went over gRPC")
        return getattr(self._stub, name)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("qc"))
    yield d
    assert d.stop() == 0


def stored(d, toks, model="m"):
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, model)
    kv = np.random.default_rng(len(toks)).standard_normal(LAYOUT.tensor_shape(len(toks))).astype(np.float16)
    c.put(toks, kv)
    return c, kv


def test_lookups_and_acquires_go_over_the_channel_with_grpcs_answers(daemon):
    toks = list(range(16 * 6))
    w, kv = stored(daemon, toks)
    fast = KVStoreClient(daemon.socket_path)
    fast.register(LAYOUT, "m")
    slow = KVStoreClient(daemon.socket_path, query_channel=False)
    slow.register(LAYOUT, "m")
    assert fast._fast is not None and slow._fast is None
    fast.stub = NoLookupsOverGrpc(fast.stub)
    keys = fast.keys(toks) + [os.urandom(32)]
    a, b = fast.lookup_keys(keys, promote_from=0, pin=True), slow.lookup_keys(keys, promote_from=0, pin=True)
    assert (a.hit_blocks, a.tiers, a.load_blocks) == (b.hit_blocks, b.tiers, b.load_blocks) == (6, a.tiers, 6)
    lease = fast.acquire(keys[:6])
    assert lease.count == 6
    out = np.zeros_like(kv)
    assert fast.get(toks, out) == len(toks) and out.tobytes() == kv.tobytes()
    lease.release(wait=True)
    # A refusal comes back as gRPC's would: code, message and the refusal the client acts on.
    missing = os.urandom(32)
    with pytest.raises(KVStoreError) as over_channel:
        fast.acquire([missing])
    with pytest.raises(KVStoreError) as over_grpc:
        slow.acquire([missing])
    assert (over_channel.value.code, over_channel.value.refusal) == (over_grpc.value.code, over_grpc.value.refusal)
    assert over_channel.value.message == over_grpc.value.message
    for c in (w, fast, slow):
        c.close()


def raw_channel(d, sid: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket_path + ".arena")
    s.sendall(sid + b"Q")
    assert s.recv(8) == bytes(8)  # admitted
    return s


def ask(s: socket.socket, method: str, req) -> tuple[int, bytes]:
    body = req.SerializeToString()
    s.sendall(FRAME.pack(len(body), METHOD_IDS[method]) + body)
    n, status = FRAME.unpack(s.recv(FRAME.size, socket.MSG_WAITALL))
    return status, s.recv(n, socket.MSG_WAITALL)


def test_a_channel_serves_its_own_session_alone(daemon):
    a, _ = stored(daemon, list(range(32)), model="a")
    b = KVStoreClient(daemon.socket_path)
    b.register(LAYOUT, "a")
    s = raw_channel(daemon, a.session_id)
    status, _ = ask(s, "Lookup", pb.LookupRequest(session_id=a.session_id, keys=b"".join(a.keys(list(range(32))))))
    assert status == 0
    status, body = ask(s, "Lookup", pb.LookupRequest(session_id=b.session_id, keys=b"".join(a.keys(list(range(32))))))
    assert status == grpc.StatusCode.PERMISSION_DENIED.value[0] and b"the session it was opened for" in body
    s.close()
    refused = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # an unknown session gets no channel
    refused.connect(daemon.socket_path + ".arena")
    refused.sendall(os.urandom(16) + b"Q")
    assert refused.recv(8) != bytes(8)
    refused.close()
    a.close()
    b.close()


@pytest.mark.parametrize("frame", [FRAME.pack(1 << 30, 1), FRAME.pack(4, 99) + b"junk", FRAME.pack(5, 1) + b"\xff" * 5],
                         ids=["too-long", "unknown-method", "not-protobuf"])
def test_a_bad_frame_ends_that_channel_and_nothing_else(daemon, frame):
    c, _ = stored(daemon, list(range(32)), model="bad")
    s = raw_channel(daemon, c.session_id)
    s.sendall(frame)
    s.settimeout(10)
    try:
        reply = s.recv(1 << 16)
    except ConnectionResetError:  # closed with the rest of the frame unread
        reply = b""
    if frame[4] == 1 and len(frame) > FRAME.size + 1:  # a frame that parses as a frame: an answer, then on
        status = FRAME.unpack(reply[:FRAME.size])[1]
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"does not parse" in reply
    else:
        assert reply == b""  # closed
    s.close()
    c.stub = NoLookupsOverGrpc(c.stub)  # the client's own channel still answers
    assert c.lookup(list(range(32))) == 32
    c.close()


def test_a_restarted_daemon_is_met_as_over_grpc(tmp_path):
    """The channel of a daemon that went away is dropped before a request is sent on it: the
    call goes over gRPC, finds its session unknown, registers again (a new channel) and is
    answered."""
    d = start_daemon(tmp_path)
    c, _ = stored(d, list(range(32)), model="r")
    old = c._fast
    assert d.stop() == 0
    d = start_daemon(tmp_path)
    try:
        assert c.lookup(list(range(32))) == 0  # the new daemon holds nothing; no error
        assert old.closed and c._fast is not None and c._fast is not old
        c.stub = NoLookupsOverGrpc(c.stub)
        assert c.lookup(list(range(32))) == 0
        c.close()
    finally:
        assert d.stop() == 0


def test_channels_are_capped_per_user_and_in_all():
    ch = QueryChannels(None, set(), None, max_total=3, max_per_user=2)
    assert ch.admit(1) == "" and ch.admit(1) == ""
    assert "2 query channels of this user are open" in ch.admit(1)
    assert ch.admit(2) == ""
    assert "3 query channels are open in all" in ch.admit(3)
    ch.release(1)
    assert ch.admit(3) == "" and len(ch) == 3


def serving(sessions, **kw):
    """A QueryChannels over ``sessions`` whose service answers every Lookup with one hit block,
    serving one end of a socket pair on a thread: (channels, client end, thread)."""

    class Service:
        def Lookup(self, req, ctx):
            return pb.LookupResponse(hit_blocks=1)

    ch = QueryChannels(Service(), sessions, threading.Lock(), **kw)
    assert ch.admit(0) == ""
    mine, theirs = socket.socketpair()
    t = threading.Thread(target=ch.serve, args=(theirs, b"s" * 16, 0), daemon=True)
    t.start()
    return ch, mine, t


def test_a_channel_ends_with_its_session_a_stalled_frame_and_the_daemon(monkeypatch):
    sessions = {b"s" * 16}
    ch, c, t = serving(sessions, idle_check_s=0.05)
    assert ask(c, "Lookup", pb.LookupRequest(session_id=b"s" * 16)) == (0, pb.LookupResponse(hit_blocks=1).SerializeToString())
    sessions.clear()  # the session ended: the idle channel notices
    t.join(5)
    assert not t.is_alive() and c.recv(1) == b"" and len(ch) == 0
    monkeypatch.setattr("kvstore.daemon.query_channel.FRAME_TIMEOUT_S", 0.2)
    ch, c, t = serving({b"s" * 16})
    c.sendall(FRAME.pack(100, 1) + b"half")  # a frame begun, never finished
    t.join(5)
    assert not t.is_alive() and len(ch) == 0
    ch, c, t = serving({b"s" * 16})
    ch.close_all()  # the daemon stops
    t.join(5)
    assert not t.is_alive() and c.recv(1) == b"" and len(ch) == 0
