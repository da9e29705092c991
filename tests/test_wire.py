"""Facts client and daemon share across the wire, each defined once: the namespace's written
form, tiers and slot states from the proto, the slot stride the daemon tells, and the typed
refusal a client retries on. Against the real daemon process; where a test needs a daemon that
answers what the real one answers only by chance of timing (a refusal on cue) or that is older
than this client (no stride), a scripted servicer of the generated gRPC class speaks the wire."""

from __future__ import annotations

import json
import os
import socket
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore.clients import KVStoreClient, KVStoreError
from kvstore.errors import REFUSAL_KEY
from kvstore.keys import Namespace
from kvstore.layout import KVLayout, LayoutError
from kvstore.tiers.arena import Arena, send_fd
from kvstore.tier_kind import TierKind
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc

NS = Namespace("llama", KVLayout(4, 2, 64, "fp16"), 1, 2, "tenant-a")
ODD = KVLayout(3, 1, 40, "fp16")  # 7680-byte blocks: slots are padded to 8192 bytes


# --- namespace ----------------------------------------------------------------------------------
def test_namespace_round_trips_through_json():
    assert Namespace.from_dict(json.loads(json.dumps(NS.to_dict()))) == NS


def test_namespace_root_is_unchanged_by_its_dict_form():
    # Computed before to_dict() existed: the hash input must not move, or every stored key would.
    assert NS.root.hex() == "4feb7254b2e337edd063937e5d59741e75598d0af331d0652e33c12ab1357001"


@pytest.mark.parametrize("change, field", [
    ({"tp_rank": "1"}, "namespace.tp_rank: must be int"),
    ({"tp_world": True}, "namespace.tp_world: must be int"),
    ({"tenant_salt": None}, "namespace.tenant_salt: must be str"),
    ({"model_id": ""}, "namespace.model_id: must be 1 to 256"),
    ({"tp_rank": 2}, "namespace.tp_rank: must be in [0, tp_world=2)"),
    ({"layout": [4]}, "namespace.layout: must be dict"),
    ({"layout": {"num_layers": "4"}}, "namespace.layout.num_layers: must be a positive integer"),
    ({"layout": {"num_layers": 4, "rows": 1}}, "namespace.layout.rows: unknown layout field"),
    ({"v": 1}, "namespace.v: unknown field"),
])
def test_bad_namespace_names_the_field(change, field):
    with pytest.raises(LayoutError) as e:
        Namespace.from_dict({**NS.to_dict(), **change})
    assert str(e.value).startswith(field), e.value


def test_namespace_missing_field_or_not_an_object():
    d = NS.to_dict()
    del d["tenant_salt"]
    with pytest.raises(ValueError, match=r"^namespace\.tenant_salt: missing"):
        Namespace.from_dict(d)
    with pytest.raises(ValueError, match=r"^namespace: must be an object, got list"):
        Namespace.from_dict([NS.to_dict()])


# --- enums --------------------------------------------------------------------------------------
def test_tier_kind_is_the_proto_tier():
    assert {t.name: t.value for t in TierKind} == {n.removeprefix("TIER_"): v for n, v in pb.Tier.items() if v}


# --- the real daemon ----------------------------------------------------------------------------
def test_daemon_tells_the_slot_stride_its_slots_have(daemon):
    c = KVStoreClient(daemon.socket_path, timeout_s=10)
    try:
        c.register(ODD, "odd")
        assert c.info.slot_stride_bytes == c.slot_stride_bytes == 8192
        w = c.reserve(c.keys(range(4 * 16)))
        assert [b - a for a, b in zip(w.offsets, w.offsets[1:])] == [8192] * 3  # a fresh tier: neighbours
        w.abort()
        kv = np.random.default_rng(1).standard_normal(ODD.tensor_shape(4 * 16)).astype(np.float16)
        assert c.put(range(4 * 16), kv) == 4
        out = np.zeros_like(kv)
        assert c.get(range(4 * 16), out) == 4 * 16 and out.tobytes() == kv.tobytes()
        assert list(c.reserve(c.keys(range(4 * 16))).states) == [pb.SLOT_PRESENT] * 4
    finally:
        c.close()


def test_reserve_while_dram_waits_for_demotion_is_a_typed_refusal(tmp_path):
    """DRAM full of blocks only DRAM holds, and no wait in the daemon: Reserve is refused with
    REFUSAL_DRAM_DEMOTING (the client would retry it), and succeeds once the client retries."""
    layout = KVLayout(8, 4, 128, "fp16", "mha")  # 256 KiB blocks; 32 MiB DRAM holds 128
    nvme = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "256MiB", "--nvme-file-bytes", "128MiB",
            "--nvme-high-watermark", "1.0", "--nvme-low-watermark", "0.9")  # no demotion until DRAM is full
    d = start_daemon(tmp_path, *nvme, "--server-reserve-wait-s", "0", dram="32MiB")
    try:
        c = KVStoreClient(d.socket_path)
        c.register(layout, "demoting")
        kv = np.zeros(layout.tensor_shape(16 * 16), np.float16)
        for s in range(8):
            assert c.put(range(s * 100_000, s * 100_000 + 16 * 16), kv) == 16
        new = c.keys(range(9_000_000, 9_000_000 + 16 * 16))
        with pytest.raises(KVStoreError) as e:
            c.reserve(new, retry_s=0)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.refusal == pb.REFUSAL_DRAM_DEMOTING
        w = c.reserve(new, retry_s=20)
        assert w.lease_id and list(w.states) == [pb.SLOT_RESERVED] * 16
        w.abort()
        c.close()
    finally:
        assert d.stop() == 0


def test_unreadable_namespace_in_the_recovery_file_is_dropped_not_fatal(tmp_path):
    layout = KVLayout(4, 2, 64, "fp16")
    nvme = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "64MiB",
            "--nvme-durable-commit", "true")
    kv = np.ones(layout.tensor_shape(64), np.float16)
    d = start_daemon(tmp_path, *nvme)
    try:
        with KVStoreClient(d.socket_path) as c:
            c.register(layout, "kept")
            assert c.put(range(64), kv) == 4
            c.register(layout, "spoilt")
            assert c.put(range(64), kv) == 4
    finally:
        assert d.stop() == 0
    path = tmp_path / "nvme" / "namespaces.json"
    known = json.loads(path.read_text())
    spoilt = next(h for h, ns in known.items() if ns["model_id"] == "spoilt")
    known[spoilt]["tp_rank"] = "0"
    path.write_text(json.dumps(known))
    d = start_daemon(tmp_path, *nvme)
    try:
        with KVStoreClient(d.socket_path) as c:
            c.register(layout, "kept")
            assert c.lookup(range(64)) == 64
            c.register(layout, "spoilt")
            assert c.lookup(range(64)) == 0
        assert "namespace.tp_rank: must be int" in d.log()
    finally:
        assert d.stop() == 0


# --- a scripted daemon ----------------------------------------------------------------------------
class Scripted(pb_grpc.KVStoreServicer):
    """Register answers ``stride`` as the slot stride; each Reserve first takes the next of
    ``refusals`` (a Refusal name for the trailing metadata, or "" for none) and is refused
    RESOURCE_EXHAUSTED with the real daemon's text; once they are spent it reserves slots."""

    MESSAGE = "DRAM tier full while blocks are being demoted to NVMe; retry in a few milliseconds"

    def __init__(self, arena_socket: str, stride: int, refusals=()) -> None:
        self.arena_socket, self.stride, self.refusals = arena_socket, stride, list(refusals)
        self.reserves = 0

    def Register(self, req, context):
        ns = Namespace(req.model_id, ODD, req.tp_rank, req.tp_world or 1, req.tenant_salt)
        return pb.RegisterResponse(session_id=b"s" * 16, namespace_id=ns.root, arena_socket=self.arena_socket,
                                   arena_bytes=ARENA_BYTES, block_bytes=ODD.block_bytes,
                                   layer_chunk_bytes=ODD.layer_chunk_bytes, lease_ttl_s=30,
                                   max_keys_per_request=64, slot_stride_bytes=self.stride)

    def Reserve(self, req, context):
        self.reserves += 1
        if self.refusals:
            name = self.refusals.pop(0)
            if name:
                context.set_trailing_metadata(((REFUSAL_KEY, name),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.MESSAGE)
        n = len(req.keys) // 32
        return pb.ReserveResponse(lease_id=1, offsets=[i * 8192 for i in range(n)], states=bytes(n))


ARENA_BYTES = 1 << 20


@pytest.fixture
def scripted(tmp_path):
    """Start a scripted daemon: ``scripted(stride, refusals)`` returns (servicer, socket path)."""
    arena = Arena(ARENA_BYTES, prefault=False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "arena.sock"))
    listener.listen(8)

    def hand_out():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed: the test is over
            with conn:
                conn.recv(17)
                send_fd(conn, arena.fd, ARENA_BYTES)

    threading.Thread(target=hand_out, daemon=True).start()
    servers = []

    def start(stride: int, refusals=()):
        svc = Scripted(str(tmp_path / "arena.sock"), stride, refusals)
        server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_KVStoreServicer_to_server(svc, server)
        path = str(tmp_path / f"kv{len(servers)}.sock")
        server.add_insecure_port(f"unix:{path}")
        server.start()
        servers.append(server)
        return svc, path

    yield start
    for s in servers:
        s.stop(0)
    listener.close()
    arena.close()
    if os.path.exists(tmp_path / "arena.sock"):
        os.unlink(tmp_path / "arena.sock")


def _client(path: str) -> KVStoreClient:
    c = KVStoreClient(path, timeout_s=5, prefault=False)
    c.register(ODD, "scripted")
    return c


def test_client_retries_reserve_on_the_typed_refusal(scripted):
    svc, path = scripted(8192, ["REFUSAL_DRAM_DEMOTING"] * 3)
    c = _client(path)
    try:
        w = c.reserve(c.keys(range(2 * 16)), retry_s=10)
        assert (w.lease_id, svc.reserves) == (1, 4)
    finally:
        c.close()


def test_client_does_not_retry_on_the_message_alone(scripted):
    svc, path = scripted(8192, [""])
    c = _client(path)
    try:
        with pytest.raises(KVStoreError) as e:
            c.reserve(c.keys(range(2 * 16)), retry_s=10)
        assert (e.value.refusal, e.value.message, svc.reserves) == (0, Scripted.MESSAGE, 1)
    finally:
        c.close()


def test_client_gives_up_retrying_at_retry_s(scripted):
    svc, path = scripted(8192, ["REFUSAL_DRAM_DEMOTING"] * 1000)
    c = _client(path)
    try:
        with pytest.raises(KVStoreError) as e:
            c.reserve(c.keys(range(2 * 16)), retry_s=0.2)
        assert e.value.refusal == pb.REFUSAL_DRAM_DEMOTING and 1 < svc.reserves < 1000
    finally:
        c.close()


@pytest.mark.parametrize("told, used", [(16384, 16384), (0, 8192)], ids=["daemon-told", "older-daemon"])
def test_client_uses_the_stride_the_daemon_tells(scripted, told, used):
    """A daemon that sends 0 is older than the field: its slots are blocks rounded up to 4096."""
    _, path = scripted(told)
    c = _client(path)
    try:
        assert c.slot_stride_bytes == used
    finally:
        c.close()


def test_stride_shorter_than_a_block_is_refused(scripted):
    _, path = scripted(4096)
    c = KVStoreClient(path, timeout_s=5, prefault=False)
    try:
        with pytest.raises(KVStoreError, match="slot stride of 4096 bytes is less than a block"):
            c.register(ODD, "scripted")
    finally:
        c.close()
