"""Property-based fuzzing of every RPC of the KVStore service against one real daemon (DRAM, NVMe
and a transfer listener). The request strategies are generated from the proto descriptors, so a
new RPC or field is fuzzed without touching this file. Every example asserts: a proper gRPC
status (never UNKNOWN or INTERNAL, which only kvstore's own unhandled errors produce; a deadline
only on the RPCs that may wait, whose wait the test caps), a message on every refusal, and the
daemon still answering Stats. At the end a block committed before the fuzzing reads back
bit-exact and the daemon is alive (and, at teardown, exits 0 on SIGTERM)."""

from __future__ import annotations

import collections
import math

import grpc
import numpy as np
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstore.clients import KVStoreClient
from kvstore.keys import KEY_BYTES, Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.v1 import kvstore_pb2 as pb
from kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.v1 import peer_pb2 as ppb
from kvstore.v1 import peer_pb2_grpc as ppb_grpc

CASES_PER_RPC = 100     # hypothesis examples per RPC (the whole file stays well under a minute)
CALL_TIMEOUT_S = 5.0    # an RPC that does not wait answers well within this; past it is a hang
WAIT_CAP_S = 0.5        # the deadline given to RPCs that may wait (their wait_s is fuzzed too)
# RPCs that wait for something by design (a transfer, a prefetch, blocks being written): for
# them alone DEADLINE_EXCEEDED at WAIT_CAP_S is a proper answer.
WAITING = {"Acquire", "PrefetchStatus", "AwaitTransfer", "Transfer", "Prefetch"}
BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

LAYOUT = KVLayout(4, 2, 64, "fp16")
TOKENS = list(range(2 * 16))   # two reference blocks
FUZZ_MODEL = "fuzz-model"
# Every service the daemon serves on its unix socket: KVStore, and Peer (Pull, and the Push and
# Lookup peers call over TLS; a daemon outside a fleet answers them UNAVAILABLE with a reason).
SERVICES = (pb.DESCRIPTOR.services_by_name["KVStore"], ppb.DESCRIPTOR.services_by_name["Peer"])

SEEN: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # method -> status counts


class Live:
    """A value only known while the test runs (the fuzz session's id, a lease or prefetch handle
    the daemon handed out), drawn as a placeholder and filled in by :meth:`State.resolve`."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"Live({self.what!r})"


class State:
    """The fuzz session and what the daemon handed it; the session is opened again whenever an
    example ended it (CloseSession, or a Register that lost it)."""

    def __init__(self, stub, transfer_addr: str, ref_keys: bytes) -> None:
        self.stub, self.transfer_addr, self.ref_keys = stub, transfer_addr, ref_keys
        self.leases: list[int] = []
        self.handles: list[int] = []
        self.open()

    def open(self) -> None:
        resp = self.stub.Register(pb.RegisterRequest(model_id=FUZZ_MODEL, layout=pb.Layout(**LAYOUT.to_dict())),
                                  timeout=CALL_TIMEOUT_S)
        self.sid, self.ns_hex = resp.session_id, resp.namespace_id.hex()
        root = Namespace(FUZZ_MODEL, LAYOUT).root
        self.keys = b"".join(chain_keys(root, TOKENS, LAYOUT.block_tokens))
        self.refill()

    def refill(self) -> None:
        """Commit the fuzz namespace's blocks again if an example deleted them (their bytes are
        whatever the arena held), so the RPCs that read, move or delete blocks find some."""
        lease = self.stub.Reserve(pb.ReserveRequest(session_id=self.sid, keys=self.keys), timeout=CALL_TIMEOUT_S)
        if lease.lease_id:
            mine = b"".join(self.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]
                            for i, state in enumerate(lease.states) if state == pb.SLOT_RESERVED)
            self.stub.Commit(pb.CommitRequest(session_id=self.sid, lease_id=lease.lease_id, keys=mine),
                             timeout=CALL_TIMEOUT_S)

    def resolve(self, v):
        if isinstance(v, list):
            return [self.resolve(x) for x in v]
        if not isinstance(v, Live):
            return v
        return {"sid": self.sid, "fuzz_keys": self.keys, "ref_keys": self.ref_keys,
                "first_key": self.keys[:KEY_BYTES], "ns_hex": self.ns_hex, "peer": self.transfer_addr,
                "lease": self.leases[-1] if self.leases else 1,
                "handle": self.handles[-1] if self.handles else 1}[v.what]

    def learn(self, resp) -> None:
        for field, into in (("lease_id", self.leases), ("handle", self.handles)):
            v = getattr(resp, field, 0)
            if v:
                into.append(v)
                del into[:-8]

    def session_alive(self) -> bool:
        try:
            self.stub.Lookup(pb.LookupRequest(session_id=self.sid, keys=b""), timeout=CALL_TIMEOUT_S)
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())
            return False


# --- strategies, from the descriptors ---------------------------------------------------------
INT_RANGES = {FD.TYPE_INT32: (-2**31, 2**31 - 1), FD.TYPE_SINT32: (-2**31, 2**31 - 1),
              FD.TYPE_SFIXED32: (-2**31, 2**31 - 1), FD.TYPE_UINT32: (0, 2**32 - 1),
              FD.TYPE_FIXED32: (0, 2**32 - 1), FD.TYPE_INT64: (-2**63, 2**63 - 1),
              FD.TYPE_SINT64: (-2**63, 2**63 - 1), FD.TYPE_SFIXED64: (-2**63, 2**63 - 1),
              FD.TYPE_UINT64: (0, 2**64 - 1), FD.TYPE_FIXED64: (0, 2**64 - 1)}
INT_EDGES = (0, 1, -1, 2, 16, 2**31 - 1, -2**31, 2**32 - 1, 2**63 - 1, -2**63, 2**64 - 1)
FLOAT_EDGES = (0.0, -0.0, -1.0, 1e-9, 0.25, 1.0, 1e9, 1e300, math.nan, math.inf, -math.inf)


def random_bytes():
    return st.one_of(st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33, 64, 65]).map(lambda n: bytes(n)),
                     st.binary(min_size=0, max_size=100))


# Fields whose meaningful values a blind generator would never hit: the live ones mixed in.
NAMED = {
    "session_id": st.one_of(st.just(Live("sid")), st.just(Live("sid")), random_bytes()),
    "keys": st.one_of(st.sampled_from([Live("fuzz_keys"), Live("ref_keys"), Live("first_key")]), random_bytes(),
                      st.integers(1, 40).map(lambda n: bytes(KEY_BYTES * n))),
    "parent": st.one_of(st.sampled_from([Live("first_key"), b""]), random_bytes()),
    "lease_id": st.one_of(st.just(Live("lease")), st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1])),
    "handle": st.one_of(st.just(Live("handle")), st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1])),
    # Never the reference namespace: dropping it is a legitimate request that would lose the block.
    "namespace_id_hex": st.one_of(st.sampled_from([Live("ns_hex"), "", "zz", "0" * 64, "0" * 63, "Ab" * 32]),
                                  st.text(max_size=70)),
    "peer": st.one_of(st.sampled_from([Live("peer"), "", "127.0.0.1:1", "127.0.0.1", ":", "[::1]:0",
                                       "127.0.0.1:99999", "127.0.0.1:-1", "no-such-host.invalid:1"]),
                      st.text(alphabet="0123456789:.[]x", max_size=12)),
    "dtype": st.one_of(st.sampled_from(["", "fp16", "bf16", "fp32", "fp8_e4m3", "int4", "fp7", "FP16"]),
                       st.text(max_size=8)),
    "kind": st.one_of(st.sampled_from(["", "mha", "gqa", "mqa", "mla", "xyz"]), st.text(max_size=6)),
    "model_id": st.one_of(st.sampled_from(["", FUZZ_MODEL, "m" * 257, "\x00", "é"]), st.text(max_size=20)),
}
LAYOUT_EDGES = st.sampled_from([pb.Layout(**LAYOUT.to_dict()), pb.Layout(), pb.Layout(num_layers=1, num_kv_heads=1, head_dim=1,
                                dtype="int4"), pb.Layout(num_layers=2**32 - 1, num_kv_heads=2**32 - 1,
                                head_dim=2**32 - 1, dtype="fp32"),
                                pb.Layout(num_layers=2, kind="mla", dtype="fp16", kv_lora_rank=512,
                                          qk_rope_head_dim=64)])


def scalar(f):
    if f.name in NAMED:
        return NAMED[f.name]
    t = f.type
    if t in INT_RANGES:
        lo, hi = INT_RANGES[t]
        return st.one_of(st.sampled_from([v for v in INT_EDGES if lo <= v <= hi]), st.integers(lo, hi))
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(allow_nan=True, allow_infinity=True))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_STRING:
        return st.one_of(st.sampled_from(["", "x" * 300, "\x00"]), st.text(max_size=20))
    if t == FD.TYPE_BYTES:
        return random_bytes()
    if t == FD.TYPE_ENUM:
        known = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([max(known) + 1, 99, -1, 2**31 - 1]))
    if t == FD.TYPE_MESSAGE:
        built = message(f.message_type)
        return st.one_of(LAYOUT_EDGES, built) if f.message_type.name == "Layout" else built
    raise AssertionError(f"{f.full_name}: no strategy for field type {t}")


def field(f):
    one = scalar(f)
    return st.lists(one, max_size=5) if f.is_repeated else one


def message(desc):
    """A strategy for ``desc``'s message: each field left unset or given a drawn value (a
    nested message is built here; placeholders stay in the dict, filled in at call time)."""
    fields = {f.name: st.one_of(st.none(), field(f)) for f in desc.fields}
    return st.fixed_dictionaries(fields).map(lambda d: {k: v for k, v in d.items() if v is not None})


# A request that would pass validation: one_of these with a single field fuzzed reaches the code
# behind the checks, which a request with every field fuzzed at once almost never does.
VALID = {"session_id": Live("sid"), "keys": Live("fuzz_keys"), "lease_id": Live("lease"), "handle": Live("handle"),
         "lease_ids": [Live("lease")], "peer": Live("peer"), "namespace_id_hex": Live("ns_hex"),
         "model_id": FUZZ_MODEL, "layout": pb.Layout(**LAYOUT.to_dict()), "wait_s": 0.05, "deadline_s": 1.0}


def one_field_off(desc):
    base = {f.name: VALID[f.name] for f in desc.fields if f.name in VALID}
    if not desc.fields:
        return st.just(base)
    return st.sampled_from([f for f in desc.fields]).flatmap(
        lambda f: field(f).map(lambda v: {**base, f.name: v}))


def request(desc):
    """Half fully random requests, half valid ones with one field fuzzed."""
    return st.one_of(message(desc), one_field_off(desc))


def build(desc, values: dict, state: State):
    msg = message_factory.GetMessageClass(desc)()
    for name, v in values.items():
        v = state.resolve(v)
        f = desc.fields_by_name[name]
        if f.type == FD.TYPE_MESSAGE:
            getattr(msg, name).CopyFrom(v if not isinstance(v, dict) else build(f.message_type, v, state))
        elif f.is_repeated:
            getattr(msg, name).extend(v)
        else:
            setattr(msg, name, v)
    return msg


# --- the daemon ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(module_daemons, tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    d = module_daemons("--nvme-dir", str(nvme), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
                       "--dram-prefault", "false", transfer="tcp")
    ref = KVStoreClient(d.socket_path, timeout_s=10)
    ref.register(LAYOUT, "reference-model")
    kv = np.random.default_rng(17).standard_normal(LAYOUT.tensor_shape(len(TOKENS))).astype(np.float16)
    assert ref.put(TOKENS, kv) == len(TOKENS) // LAYOUT.block_tokens
    channel = grpc.insecure_channel(f"unix:{d.socket_path}")
    state = State(pb_grpc.KVStoreStub(channel), d.transfer_addr, b"".join(ref.keys(TOKENS)))
    state.peer_stub = ppb_grpc.PeerStub(channel)
    yield d, ref, kv, state
    channel.close()
    ref.close()


def call_one(world, method, values):
    d, _, _, state = world
    req = build(method.input_type, values, state)
    timeout = WAIT_CAP_S if method.name in WAITING else CALL_TIMEOUT_S
    try:
        stub = state.stub if method.containing_service.name == "KVStore" else state.peer_stub
        resp = getattr(stub, method.name)(req, timeout=timeout)
        code, details = grpc.StatusCode.OK, ""
        state.learn(resp)
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    SEEN[method.full_name.removeprefix("kvstore.v1.")][code.name] += 1
    assert code not in BROKEN, f"{method.name}({req}) -> {code.name}: {details}"
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED or method.name in WAITING, \
        f"{method.name}({req}) hung past {timeout} s"
    assert code == grpc.StatusCode.OK or details.strip(), f"{method.name}({req}) -> {code.name} with no message"
    # The daemon still serves, and the fuzz session is there for the next example.
    state.stub.Stats(pb.StatsRequest(), timeout=CALL_TIMEOUT_S)
    assert d.alive()
    if not state.session_alive():
        state.open()
    state.refill()


# Inputs that once broke the daemon, replayed on every run (method name -> field values).
EXAMPLES: dict[str, list[dict]] = {
    # No keys: was INTERNAL (the sender's ValueError), now INVALID_ARGUMENT.
    "Transfer": [dict(session_id=Live("sid"), keys=b"", peer=Live("peer"), deadline_s=1.0),
                 # A deadline past time_t: was INTERNAL (OverflowError), now INVALID_ARGUMENT.
                 dict(session_id=Live("sid"), keys=Live("fuzz_keys"), peer=Live("peer"), deadline_s=1e300)],
}


def fuzz_test(method, name: str):
    @settings(max_examples=CASES_PER_RPC, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(values=request(method.input_type))
    def test(world, values):
        call_one(world, method, values)

    for ex in EXAMPLES.get(method.name, ()):
        test = example(values=ex)(test)
    test.__name__ = f"test_fuzz_{name}"
    return test


for _svc in SERVICES:
    for _m in _svc.methods:
        name = _m.name if _svc.name == "KVStore" else f"{_svc.name}_{_m.name}"
        globals()[f"test_fuzz_{name}"] = fuzz_test(_m, name)


def test_reference_blocks_intact_and_daemon_alive(world):
    """Runs after the fuzz tests (file order): what was committed before them reads back
    bit-exact, through the real client's arena path."""
    d, ref, kv, _ = world
    out = np.zeros_like(kv)
    assert ref.get(TOKENS, out) == len(TOKENS)
    assert out.tobytes() == kv.tobytes()
    assert d.alive()
    print("\nstatuses per RPC:")
    for name in sorted(SEEN):
        print(f"  {name:20s} " + ", ".join(f"{k}={v}" for k, v in sorted(SEEN[name].items())))
