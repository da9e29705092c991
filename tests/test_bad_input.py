"""Bad input against the real daemon: the right gRPC status, a clear message, the daemon keeps
serving and no committed block is lost."""

import itertools
import os
import socket
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.layout import KVLayout
from kvstore.app.local import start_daemon
from kvstore.v1 import kvstore_pb2 as pb

LAYOUT = KVLayout(4, 2, 64, "fp16")
SHARE_DAEMON = True  # one daemon for the module: each test's blocks come from tokens of its own
_TOKEN_BASES = itertools.count(0, 64)


@pytest.fixture
def setup(daemon, client_factory):
    c = client_factory(LAYOUT)
    base = next(_TOKEN_BASES)  # 4 blocks no other test of the module stores
    tokens = list(range(base, base + 4 * 16))
    kv = np.random.default_rng(0).standard_normal(LAYOUT.tensor_shape(len(tokens))).astype(np.float16)
    assert c.put(tokens, kv) == 4
    yield c, tokens, kv
    # Whatever the test threw at it, the committed blocks are intact and readable.
    out = np.zeros_like(kv)
    assert c.get(tokens, out) == len(tokens)
    assert out.tobytes() == kv.tobytes()
    assert daemon.alive()


def expect(code, fn, *words):
    with pytest.raises(KVStoreError) as e:
        fn()
    assert e.value.code == code, e.value
    for w in words:
        assert w in e.value.message, e.value.message
    return e.value


def test_unknown_session(setup):
    c, _, _ = setup
    expect(grpc.StatusCode.NOT_FOUND,
           lambda: c.call("Lookup", pb.LookupRequest(session_id=b"x" * 16, keys=b"")), "unknown session", "Register")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: c.call("Lookup", pb.LookupRequest(session_id=b"short", keys=b"")), "session_id", "16 bytes")


def test_unknown_namespace_layout_fields(setup):
    c, _, _ = setup
    bad = pb.RegisterRequest(model_id="m", layout=pb.Layout(num_layers=0, num_kv_heads=2, head_dim=64, dtype="fp16"))
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call("Register", bad), "num_layers")
    bad = pb.RegisterRequest(model_id="m", layout=pb.Layout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp7"))
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call("Register", bad), "dtype", "fp7")
    bad = pb.RegisterRequest(model_id="", layout=pb.Layout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp16"))
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call("Register", bad), "model_id")
    huge = pb.RegisterRequest(model_id="m", layout=pb.Layout(num_layers=4096, num_kv_heads=64, head_dim=128, dtype="fp32"))
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: c.call("Register", huge), "extent")


def test_malformed_and_wrong_length_keys(setup):
    c, tokens, _ = setup
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: c.call("Lookup", pb.LookupRequest(session_id=c.session_id, keys=b"\x01" * 33)), "32-byte")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: c.call("Reserve", pb.ReserveRequest(session_id=c.session_id, keys=b"\x01" * 31)), "32-byte")
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: c.call("Reserve", pb.ReserveRequest(session_id=c.session_id, keys=b"\x01" * 32, parent=b"xx")), "parent")
    expect(grpc.StatusCode.INVALID_ARGUMENT,  # a block its own ancestor: a loop the directory would walk
           lambda: c.call("Reserve", pb.ReserveRequest(session_id=c.session_id, keys=b"\x07" * 64, parent=b"\x07" * 32)),
           "own ancestor")
    k = c.keys(tokens)[0]
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.reserve([b"\x05" * 32, b"\x05" * 32]), "twice")
    assert c.lookup_keys([b"\x00" * 32, k]).hit_blocks == 0  # unknown key: a miss, not an error


def test_token_ids_on_a_daemon_without_kv_events_are_size_checked_not_hashed(setup):
    """Nothing reads token ids without [events] publish: a list of the wrong size is refused (a
    free check that catches a wrong dtype), one of the right size is neither hashed nor kept
    (tests/test_kv_events.py: with events on, the same list is refused)."""
    c, _, _ = setup
    keys = c.keys(range(900_000, 900_000 + 32))
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.reserve(keys, token_ids=np.zeros(32, np.int64).view("<i4")),
           "token_ids: 256 bytes", "need 128")
    w = c.reserve(keys, token_ids=list(range(1, 33)))  # not the keys' tokens: ignored, not refused
    assert list(w.states) == [pb.SLOT_RESERVED] * 2
    w.abort()


def test_counts_over_the_limit(daemons):
    d = daemons("--server-max-keys-per-request", "8")
    c = KVStoreClient(d.socket_path)
    c.register(LAYOUT, "m")
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.lookup_keys([bytes([i]) * 32 for i in range(9)]),
           "9 keys exceed the limit of 8")
    assert c.lookup_keys([bytes([i]) * 32 for i in range(8)]).hit_blocks == 0
    # The client splits big puts into batches under the limit.
    tokens = list(range(20 * 16))
    kv = np.ones(LAYOUT.tensor_shape(len(tokens)), np.float16)
    assert c.put(tokens, kv) == 20
    c.close()


def test_buffer_sizes_that_do_not_match_the_layout(setup):
    c, tokens, kv = setup
    with pytest.raises(ValueError, match="bytes per token per layer"):
        c.put(tokens, kv.astype(np.float32))
    with pytest.raises(ValueError, match="dimension 1 must be 2"):
        c.put(tokens, np.zeros((4, 3, 64, 2, 64), np.float16))
    with pytest.raises(ValueError, match="expected shape"):
        c.put(tokens, np.zeros((5, 2, 64, 2, 64), np.float16))
    with pytest.raises(ValueError, match="contiguous"):
        c.get(tokens, np.zeros((4, 2, 64, 64, 2), np.float16).transpose(0, 1, 2, 4, 3))


def test_reading_an_uncommitted_block(setup):
    c, tokens, _ = setup
    keys = c.keys(tokens + [7] * 16)
    w = c.reserve([keys[-1]], parent=keys[-2])
    expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: c.acquire([keys[-1]]), "not committed")
    assert c.lookup_keys(keys).hit_blocks == 4
    w.abort()
    expect(grpc.StatusCode.NOT_FOUND, lambda: c.acquire([keys[-1]]), "no such block")


def test_two_clients_committing_the_same_key_at_once(setup, client_factory):
    c, tokens, _ = setup
    c2 = client_factory(LAYOUT)
    k = c.keys(tokens + [9] * 16)[-1]
    w1 = c.reserve([k])
    w2 = c2.reserve([k])
    assert w1.states == bytes([pb.SLOT_RESERVED]) and w2.states == bytes([pb.SLOT_BUSY]) and w2.lease_id == 0
    expect(grpc.StatusCode.NOT_FOUND,
           lambda: c2.call("Commit", pb.CommitRequest(session_id=c2.session_id, lease_id=w1.lease_id + 1000)), "lease")
    expect(grpc.StatusCode.PERMISSION_DENIED,
           lambda: c2.call("Commit", pb.CommitRequest(session_id=c2.session_id, lease_id=w1.lease_id)), "another session")
    w1.view(0)[:] = 3
    assert w1.commit() == 1
    with c2.acquire([k]) as r:
        assert (r.view(0) == 3).all()


def test_reservation_larger_than_the_tier(setup):
    c, tokens, _ = setup
    cap = c.stats().tiers[0].capacity_bytes // LAYOUT.block_bytes
    keys = c.keys([5] * 16 * (cap + 1))
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: c.reserve(keys), "exceeds the DRAM tier", f"at most {cap}")


def test_namespace_a_asking_for_namespace_b(setup, client_factory):
    c, tokens, _ = setup
    other = client_factory(LAYOUT, model_id="test-model", tenant_salt="tenant-b")
    keys = c.keys(tokens)
    assert other.lookup_keys(keys).hit_blocks == 0
    expect(grpc.StatusCode.NOT_FOUND, lambda: other.acquire(keys), "this session's namespace")
    assert other.delete(keys) == 0


def test_bad_config_is_a_clear_error_before_anything_starts(tmp_path):
    sock = tmp_path / "k.sock"
    for args, key in ((["--dram-capacity-bytes", "lots"], "dram.capacity_bytes"),
                      (["--server-lease-ttl-s", "-1"], "server.lease_ttl_s"),
                      (["--server-session-ttl-s", "0.5"], "server.session_ttl_s"),
                      (["--server-reserve-wait-s", "-1"], "server.reserve_wait_s"),
                      (["--transport-backend", "carrier-pigeon"], "transport.backend"),
                      (["--transport-ucx-progress", "spin"], "transport.ucx_progress"),
                      (["--transport-verify-threads", "-2"], "transport.verify_threads"),
                      (["--server-tcp-listen", "0.0.0.0:7000"], "requires TLS"),
                      (["--server-socket-path", f"{tmp_path}/{'s' * 100}.sock"], "too long for a unix socket")):
        p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--server-socket-path", str(sock), *args],
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 2, p.stderr
        assert key in p.stderr
        assert not sock.exists()
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[dram]\ncapacity_bytes = 'x'\n")
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "dram.capacity_bytes" in p.stderr
    env = {**os.environ, "KVSTORE_METRICS_PORT": "99999"}
    p = subprocess.run([sys.executable, "-m", "kvstore", "serve"], capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 2 and "metrics.port" in p.stderr


def test_a_local_daemon_in_a_directory_too_deep_for_a_socket_path_still_starts(tmp_path):
    """``kvstore.app.local.start_daemon`` (the benchmarks' daemons, ``--dir`` anywhere): a work
    directory whose socket path would pass the 107-byte limit gets its sockets in a private
    directory of their own, removed at stop; the log stays in the work directory."""
    deep = tmp_path / ("d" * 100)
    d = start_daemon(deep, "deep", "--dram-capacity-bytes", "16MiB", "--dram-extent-bytes", "4MiB", "--dram-prefault", "false")
    try:
        sock_dir = os.path.dirname(d.socket_path)
        assert not d.socket_path.startswith(str(deep)) and os.stat(sock_dir).st_mode & 0o777 == 0o700
        assert KVStoreClient(d.socket_path).stats().version
    finally:
        assert d.stop() == 0
    assert not os.path.exists(sock_dir) and (deep / "deep.log").exists()
    again = start_daemon(deep, "deep", "--dram-capacity-bytes", "16MiB", "--dram-extent-bytes", "4MiB",
                         "--dram-prefault", "false")
    assert again.socket_path == d.socket_path  # restarted there: where its clients look for it
    assert again.stop() == 0


def test_prefetch_into_an_unknown_tier(setup):
    c, tokens, _ = setup
    keys = b"".join(c.keys(tokens))
    for target in (99, -1):
        err = expect(grpc.StatusCode.INVALID_ARGUMENT,
                     lambda: c.call("Prefetch", pb.PrefetchRequest(session_id=c.session_id, keys=keys, target=target)),
                     "target", str(target), "TIER_DRAM")
        assert "internal" not in err.message
    expect(grpc.StatusCode.INVALID_ARGUMENT,
           lambda: c.call("Prefetch", pb.PrefetchRequest(session_id=c.session_id, keys=keys, target=pb.TIER_NVME)),
           "target", "TIER_DRAM")


def test_min_blocks_without_allow_partial_is_refused_and_with_it_pins_the_leading_blocks(setup):
    """An Acquire that may answer before every key is in DRAM can pin only the leading ones: it
    must allow a partial answer. The largest min_blocks is as good as "all of them"."""
    c, tokens, _ = setup
    keys = b"".join(c.keys(tokens))
    req = pb.AcquireRequest(session_id=c.session_id, keys=keys, min_blocks=2, wait_s=0.5)
    expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call("Acquire", req, timeout_s=5), "min_blocks",
           "allow_partial or each")
    r = c.call("Acquire", pb.AcquireRequest(session_id=c.session_id, keys=keys, min_blocks=2**32 - 1,
                                            allow_partial=True, wait_s=0.5), timeout_s=5)
    assert r.acquired == len(c.keys(tokens)) and r.lease_id
    c.call("Release", pb.ReleaseRequest(session_id=c.session_id, lease_id=r.lease_id))


NOT_FINITE = (float("nan"), float("inf"), -float("inf"), -1.0)


def test_seconds_and_rates_that_are_not_finite(setup):
    """NaN and infinity in a time or a rate are refused by name: a NaN wait once waited forever
    (min(nan, cap) is nan) and a NaN rate poisoned the load-or-recompute advice."""
    c, tokens, _ = setup
    sid, keys = c.session_id, b"".join(c.keys(tokens))
    lay = pb.Layout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16")
    for v in NOT_FINITE:
        for method, req, field in (
                ("Acquire", pb.AcquireRequest(session_id=sid, keys=keys, wait_s=v), "wait_s"),
                ("Prefetch", pb.PrefetchRequest(session_id=sid, keys=keys, deadline_s=v), "deadline_s"),
                ("PrefetchStatus", pb.PrefetchStatusRequest(session_id=sid, handle=1, wait_s=v), "wait_s"),
                ("AwaitTransfer", pb.AwaitTransferRequest(session_id=sid, keys=keys, wait_s=v), "wait_s"),
                ("Transfer", pb.TransferRequest(session_id=sid, keys=keys, peer="127.0.0.1:1", deadline_s=v),
                 "deadline_s"),
                ("Register", pb.RegisterRequest(model_id="m", layout=lay, prefill_tokens_per_s=v),
                 "prefill_tokens_per_s"),
                ("Register", pb.RegisterRequest(model_id="m", layout=lay, model_params=v), "model_params")):
            expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: c.call(method, req, timeout_s=5), field)


def test_boundary_integers_get_a_status_not_a_crash(setup):
    c, tokens, _ = setup
    sid, top = c.session_id, 2**64 - 1
    lay = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="fp16")
    for method, req, code in (
            ("Commit", pb.CommitRequest(session_id=sid, lease_id=top), grpc.StatusCode.NOT_FOUND),
            ("Abort", pb.AbortRequest(session_id=sid, lease_id=0), grpc.StatusCode.NOT_FOUND),
            ("Release", pb.ReleaseRequest(session_id=sid, lease_id=top), grpc.StatusCode.NOT_FOUND),
            ("PrefetchStatus", pb.PrefetchStatusRequest(session_id=sid, handle=top), grpc.StatusCode.NOT_FOUND),
            ("Register", pb.RegisterRequest(model_id="m", layout=pb.Layout(**lay), tp_rank=2**32 - 1, tp_world=2),
             grpc.StatusCode.INVALID_ARGUMENT),
            ("Register", pb.RegisterRequest(model_id="m", layout=pb.Layout(**{**lay, "num_layers": 2**32 - 1})),
             grpc.StatusCode.RESOURCE_EXHAUSTED),
            ("Register", pb.RegisterRequest(model_id="m", layout=pb.Layout(**{**lay, "block_tokens": 2**32 - 1})),
             grpc.StatusCode.RESOURCE_EXHAUSTED),
            ("Register", pb.RegisterRequest(model_id="m", layout=pb.Layout(**{**lay, "kind": "mla"})),
             grpc.StatusCode.INVALID_ARGUMENT),
            ("DropNamespace", pb.DropNamespaceRequest(namespace_id_hex="zz"), grpc.StatusCode.INVALID_ARGUMENT)):
        e = expect(code, lambda: c.call(method, req, timeout_s=5))
        assert e.message and "internal" not in e.message, e.message
    assert c.keepalive([0, top]) == [0, top]


def nvme_daemon(tmp_path, nvme):
    from daemon_util import start_daemon

    return start_daemon(tmp_path, "--nvme-dir", str(nvme), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes",
                        "32MiB", "--nvme-durable-commit", "true", "--dram-prefault", "false")


@pytest.mark.parametrize("content", ["[1, 2]", '"a string"', '{"00ff": [1]}', '{"00ff": {"model_id": 5}}', "{not json"])
def test_a_namespaces_file_of_the_wrong_shape_is_quarantined(tmp_path, content):
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o700)
    (nvme / "namespaces.json").write_text(content)
    d = nvme_daemon(tmp_path, nvme)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "m")  # writes a fresh namespaces.json
        tokens = list(range(32))
        assert c.put(tokens, np.ones(LAYOUT.tensor_shape(len(tokens)), np.float16)) == 2
        c.close()
    finally:
        assert d.stop() == 0
    log = d.log()
    assert "Traceback" not in log, log
    assert "namespaces.json" in log and "quarantined" in log, log
    aside = [p for p in nvme.iterdir() if p.name.startswith("namespaces.json.bad-")]
    assert len(aside) == 1 and aside[0].read_text() == content
    # The file written since is good: a restart recovers the blocks without complaint.
    d = nvme_daemon(tmp_path, nvme)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "m")
        assert c.lookup(list(range(32))) == 32
        c.close()
    finally:
        assert d.stop() == 0
    assert "quarantined" not in d.log()[len(log):]


def test_a_damaged_index_geometry_disables_the_tier_with_a_clear_message(tmp_path):
    import lmdb

    nvme = tmp_path / "nvme"
    d = nvme_daemon(tmp_path, nvme)
    try:
        c = KVStoreClient(d.socket_path)
        c.register(LAYOUT, "m")
        assert c.put(list(range(32)), np.ones(LAYOUT.tensor_shape(32), np.float16)) == 2  # durable: on NVMe
        c.close()
    finally:
        assert d.stop() == 0
    for raw in (b"[1, 2]", b"{not json", b"\xff\xfe"):
        env = lmdb.open(str(nvme / "index"), max_dbs=2)
        with env.begin(write=True, db=env.open_db(b"meta")) as txn:
            txn.put(b"geometry", raw)
        env.close()
        d = nvme_daemon(tmp_path, nvme)
        try:
            c = KVStoreClient(d.socket_path)
            nv = {t.tier: t for t in c.stats().tiers}[3]
            assert not nv.enabled and "laid out with" in nv.detail, nv.detail
            c.close()
        finally:
            assert d.stop() == 0
        assert "Traceback" not in d.log(), d.log()


def test_free_port_never_hands_a_port_twice_and_keeps_to_its_range():
    """``free_port`` (every benchmark's and test's listener ports): a port handed out is never
    handed again in the same process, even before anything binds it (two picks for one daemon
    once met), a port in use is skipped, and a range it cannot fill is refused. Nine ports below
    the tests' own range, held here first so nothing else has them."""
    from kvstore.app.local import free_port

    held = None
    for base in range(10000, 19000, 97):
        socks = [socket.socket() for _ in range(9)]
        try:
            for k, s in enumerate(socks):
                s.bind(("127.0.0.1", base + k))
            held = base
            break
        except OSError:
            pass
        finally:
            for s in socks[1:] if held is not None else socks:
                s.close()
    assert held is not None, "no nine free loopback ports in a row below 19000"
    with socks[0]:  # the one in use
        got = [free_port(held, held + 9) for _ in range(8)]
        assert sorted(got) == list(range(held + 1, held + 9))
        with pytest.raises(RuntimeError, match="no free loopback port"):
            free_port(held, held + 1)
    with pytest.raises(ValueError, match="empty range"):
        free_port(30000, 30000)
