from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    REFUSAL_SESSION_UNKNOWN: _ClassVar[Refusal]
    REFUSAL_DRAM_DEMOTING: _ClassVar[Refusal]

class Advice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVICE_UNSPECIFIED: _ClassVar[Advice]
    ADVICE_LOAD: _ClassVar[Advice]
    ADVICE_PULL: _ClassVar[Advice]
    ADVICE_RECOMPUTE: _ClassVar[Advice]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_RESERVED: _ClassVar[SlotState]
    SLOT_PRESENT: _ClassVar[SlotState]
    SLOT_BUSY: _ClassVar[SlotState]

class PrefetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_RUNNING: _ClassVar[PrefetchState]
    PREFETCH_DONE: _ClassVar[PrefetchState]
    PREFETCH_PARTIAL: _ClassVar[PrefetchState]
    PREFETCH_FAILED: _ClassVar[PrefetchState]

class StreamState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_LIVE: _ClassVar[StreamState]
    STREAM_SNAPSHOT: _ClassVar[StreamState]
    STREAM_REPLAY: _ClassVar[StreamState]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_RUNNING: _ClassVar[TransferState]
    TRANSFER_DONE: _ClassVar[TransferState]
    TRANSFER_FAILED: _ClassVar[TransferState]
    TRANSFER_UNKNOWN: _ClassVar[TransferState]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
TIER_REMOTE: Tier
REFUSAL_UNSPECIFIED: Refusal
REFUSAL_SESSION_UNKNOWN: Refusal
REFUSAL_DRAM_DEMOTING: Refusal
ADVICE_UNSPECIFIED: Advice
ADVICE_LOAD: Advice
ADVICE_PULL: Advice
ADVICE_RECOMPUTE: Advice
SLOT_RESERVED: SlotState
SLOT_PRESENT: SlotState
SLOT_BUSY: SlotState
PREFETCH_RUNNING: PrefetchState
PREFETCH_DONE: PrefetchState
PREFETCH_PARTIAL: PrefetchState
PREFETCH_FAILED: PrefetchState
STREAM_LIVE: StreamState
STREAM_SNAPSHOT: StreamState
STREAM_REPLAY: StreamState
TRANSFER_RUNNING: TransferState
TRANSFER_DONE: TransferState
TRANSFER_FAILED: TransferState
TRANSFER_UNKNOWN: TransferState

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "kind", "block_tokens", "kv_lora_rank", "qk_rope_head_dim", "state_bytes")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    QK_ROPE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kind: str
    block_tokens: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    state_bytes: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., kind: _Optional[str] = ..., block_tokens: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., qk_rope_head_dim: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("model_id", "layout", "tp_rank", "tp_world", "tenant_salt", "prefill_tokens_per_s", "model_params", "client_name", "kv_codec")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_CODEC_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    layout: Layout
    tp_rank: int
    tp_world: int
    tenant_salt: str
    prefill_tokens_per_s: float
    model_params: float
    client_name: str
    kv_codec: str
    def __init__(self, model_id: _Optional[str] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., tp_rank: _Optional[int] = ..., tp_world: _Optional[int] = ..., tenant_salt: _Optional[str] = ..., prefill_tokens_per_s: _Optional[float] = ..., model_params: _Optional[float] = ..., client_name: _Optional[str] = ..., kv_codec: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "namespace_id", "arena_socket", "arena_bytes", "block_bytes", "layer_chunk_bytes", "lease_ttl_s", "max_keys_per_request", "hbm_emulated", "durable_commit", "session_ttl_s", "slot_stride_bytes", "arena_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    HBM_EMULATED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace_id: bytes
    arena_socket: str
    arena_bytes: int
    block_bytes: int
    layer_chunk_bytes: int
    lease_ttl_s: float
    max_keys_per_request: int
    hbm_emulated: bool
    durable_commit: bool
    session_ttl_s: float
    slot_stride_bytes: int
    arena_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., namespace_id: _Optional[bytes] = ..., arena_socket: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., layer_chunk_bytes: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ..., max_keys_per_request: _Optional[int] = ..., hbm_emulated: _Optional[bool] = ..., durable_commit: _Optional[bool] = ..., session_ttl_s: _Optional[float] = ..., slot_stride_bytes: _Optional[int] = ..., arena_id: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "keys", "ask_peers", "each", "promote", "promote_from", "promote_to", "pin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ASK_PEERS_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_FROM_FIELD_NUMBER: _ClassVar[int]
    PROMOTE_TO_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    ask_peers: bool
    each: bool
    promote: bool
    promote_from: int
    promote_to: int
    pin: bool
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., ask_peers: _Optional[bool] = ..., each: _Optional[bool] = ..., promote: _Optional[bool] = ..., promote_from: _Optional[int] = ..., promote_to: _Optional[int] = ..., pin: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_blocks", "tiers", "load_blocks", "est_load_s", "est_recompute_s", "reason", "advice", "remote_blocks", "remote_node_id", "remote_epoch", "remote_tier", "est_pull_s", "time_if_load_s", "time_if_pull_s", "time_if_recompute_s", "found", "lease_id", "offsets")
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EST_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    EST_RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADVICE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    EST_PULL_S_FIELD_NUMBER: _ClassVar[int]
    TIME_IF_LOAD_S_FIELD_NUMBER: _ClassVar[int]
    TIME_IF_PULL_S_FIELD_NUMBER: _ClassVar[int]
    TIME_IF_RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    hit_blocks: int
    tiers: bytes
    load_blocks: int
    est_load_s: float
    est_recompute_s: float
    reason: str
    advice: Advice
    remote_blocks: int
    remote_node_id: str
    remote_epoch: int
    remote_tier: Tier
    est_pull_s: float
    time_if_load_s: float
    time_if_pull_s: float
    time_if_recompute_s: float
    found: bytes
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hit_blocks: _Optional[int] = ..., tiers: _Optional[bytes] = ..., load_blocks: _Optional[int] = ..., est_load_s: _Optional[float] = ..., est_recompute_s: _Optional[float] = ..., reason: _Optional[str] = ..., advice: _Optional[_Union[Advice, str]] = ..., remote_blocks: _Optional[int] = ..., remote_node_id: _Optional[str] = ..., remote_epoch: _Optional[int] = ..., remote_tier: _Optional[_Union[Tier, str]] = ..., est_pull_s: _Optional[float] = ..., time_if_load_s: _Optional[float] = ..., time_if_pull_s: _Optional[float] = ..., time_if_recompute_s: _Optional[float] = ..., found: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class RouteHintsRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "token_ids", "max_nodes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_nodes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class NodeHint(_message.Message):
    __slots__ = ("node_id", "epoch", "local", "hbm_tokens", "dram_tokens", "nvme_tokens", "advice", "pull_from", "time_to_kv_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    HBM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NVME_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADVICE_FIELD_NUMBER: _ClassVar[int]
    PULL_FROM_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_KV_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    local: bool
    hbm_tokens: int
    dram_tokens: int
    nvme_tokens: int
    advice: Advice
    pull_from: str
    time_to_kv_s: float
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., local: _Optional[bool] = ..., hbm_tokens: _Optional[int] = ..., dram_tokens: _Optional[int] = ..., nvme_tokens: _Optional[int] = ..., advice: _Optional[_Union[Advice, str]] = ..., pull_from: _Optional[str] = ..., time_to_kv_s: _Optional[float] = ...) -> None: ...

class RouteHintsResponse(_message.Message):
    __slots__ = ("prompt_tokens", "recompute_s", "nodes", "reason", "elsewhere_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ELSEWHERE_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    recompute_s: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeHint]
    reason: str
    elsewhere_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., recompute_s: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeHint, _Mapping]]] = ..., reason: _Optional[str] = ..., elsewhere_s: _Optional[float] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "keys", "parent", "doorbell", "token_ids", "part", "parts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    parent: bytes
    doorbell: bool
    token_ids: bytes
    part: int
    parts: int
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., doorbell: _Optional[bool] = ..., token_ids: _Optional[bytes] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "states", "expires_in_s", "doorbell_offset")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    states: bytes
    expires_in_s: float
    doorbell_offset: int
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., states: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ..., doorbell_offset: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_id: int
    keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., keys: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_id: int
    def __init__(self, session_id: _Optional[bytes] = ..., lease_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: int
    def __init__(self, freed: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "keys", "allow_partial", "wait_s", "each", "min_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    allow_partial: bool
    wait_s: float
    each: bool
    min_blocks: int
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., allow_partial: _Optional[bool] = ..., wait_s: _Optional[float] = ..., each: _Optional[bool] = ..., min_blocks: _Optional[int] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "acquired", "expires_in_s", "hbm_offsets", "found")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ACQUIRED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    HBM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    acquired: int
    expires_in_s: float
    hbm_offsets: _containers.RepeatedScalarFieldContainer[int]
    found: bytes
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., acquired: _Optional[int] = ..., expires_in_s: _Optional[float] = ..., hbm_offsets: _Optional[_Iterable[int]] = ..., found: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_id: int
    def __init__(self, session_id: _Optional[bytes] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id", "lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("expired", "expires_in_s", "session_ttl_s")
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    expired: _containers.RepeatedScalarFieldContainer[int]
    expires_in_s: float
    session_ttl_s: float
    def __init__(self, expired: _Optional[_Iterable[int]] = ..., expires_in_s: _Optional[float] = ..., session_ttl_s: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("leases_ended",)
    LEASES_ENDED_FIELD_NUMBER: _ClassVar[int]
    leases_ended: int
    def __init__(self, leases_ended: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("session_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "busy")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    busy: int
    def __init__(self, deleted: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "keys", "target", "deadline_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    target: Tier
    deadline_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., target: _Optional[_Union[Tier, str]] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    def __init__(self, handle: _Optional[int] = ...) -> None: ...

class PrefetchStatusRequest(_message.Message):
    __slots__ = ("session_id", "handle", "wait_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    handle: int
    wait_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., handle: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PrefetchStatusResponse(_message.Message):
    __slots__ = ("state", "ready_blocks", "total_blocks", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: PrefetchState
    ready_blocks: int
    total_blocks: int
    detail: str
    def __init__(self, state: _Optional[_Union[PrefetchState, str]] = ..., ready_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "emulated", "enabled", "detail")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    blocks: int
    emulated: bool
    enabled: bool
    detail: str
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., emulated: _Optional[bool] = ..., enabled: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model_id", "block_bytes", "blocks_by_tier", "bytes_by_tier", "sessions")
    class BlocksByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BytesByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    model_id: str
    block_bytes: int
    blocks_by_tier: _containers.ScalarMap[str, int]
    bytes_by_tier: _containers.ScalarMap[str, int]
    sessions: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., model_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., blocks_by_tier: _Optional[_Mapping[str, int]] = ..., bytes_by_tier: _Optional[_Mapping[str, int]] = ..., sessions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "tiers", "namespaces", "counters", "hbm_emulated", "links", "streams", "directory")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    HBM_EMULATED_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    counters: _containers.ScalarMap[str, float]
    hbm_emulated: bool
    links: _containers.RepeatedCompositeFieldContainer[PeerLink]
    streams: _containers.RepeatedCompositeFieldContainer[EventStream]
    directory: DirectorySize
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., hbm_emulated: _Optional[bool] = ..., links: _Optional[_Iterable[_Union[PeerLink, _Mapping]]] = ..., streams: _Optional[_Iterable[_Union[EventStream, _Mapping]]] = ..., directory: _Optional[_Union[DirectorySize, _Mapping]] = ...) -> None: ...

class EventStream(_message.Message):
    __slots__ = ("node_id", "epoch", "state", "next_seq", "entries", "batches", "last_batch_age_s", "lag_s", "held_batches", "replays", "snapshots", "drops")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    HELD_BATCHES_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: int
    state: StreamState
    next_seq: int
    entries: int
    batches: int
    last_batch_age_s: float
    lag_s: float
    held_batches: int
    replays: int
    snapshots: int
    drops: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[StreamState, str]] = ..., next_seq: _Optional[int] = ..., entries: _Optional[int] = ..., batches: _Optional[int] = ..., last_batch_age_s: _Optional[float] = ..., lag_s: _Optional[float] = ..., held_batches: _Optional[int] = ..., replays: _Optional[int] = ..., snapshots: _Optional[int] = ..., drops: _Optional[int] = ...) -> None: ...

class DirectorySize(_message.Message):
    __slots__ = ("entries", "blocks", "approx_bytes", "backend")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    APPROX_BYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    entries: int
    blocks: int
    approx_bytes: int
    backend: str
    def __init__(self, entries: _Optional[int] = ..., blocks: _Optional[int] = ..., approx_bytes: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class PeerLink(_message.Message):
    __slots__ = ("node_id", "bytes_per_s", "rtt_s", "pulls", "round_trips")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RTT_S_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    bytes_per_s: float
    rtt_s: float
    pulls: int
    round_trips: int
    def __init__(self, node_id: _Optional[str] = ..., bytes_per_s: _Optional[float] = ..., rtt_s: _Optional[float] = ..., pulls: _Optional[int] = ..., round_trips: _Optional[int] = ...) -> None: ...

class DropNamespaceRequest(_message.Message):
    __slots__ = ("namespace_id_hex",)
    NAMESPACE_ID_HEX_FIELD_NUMBER: _ClassVar[int]
    namespace_id_hex: str
    def __init__(self, namespace_id_hex: _Optional[str] = ...) -> None: ...

class DropNamespaceResponse(_message.Message):
    __slots__ = ("dropped", "busy")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    busy: int
    def __init__(self, dropped: _Optional[int] = ..., busy: _Optional[int] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "keys", "peer", "deadline_s", "pipelined", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    peer: str
    deadline_s: float
    pipelined: bool
    lease_id: int
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., peer: _Optional[str] = ..., deadline_s: _Optional[float] = ..., pipelined: _Optional[bool] = ..., lease_id: _Optional[int] = ...) -> None: ...

class AwaitTransferRequest(_message.Message):
    __slots__ = ("session_id", "keys", "wait_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    wait_s: float
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AwaitTransferResponse(_message.Message):
    __slots__ = ("state", "lease_id", "offsets", "doorbell_offset", "layers_ready", "detail")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYERS_READY_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    doorbell_offset: int
    layers_ready: int
    detail: str
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., doorbell_offset: _Optional[int] = ..., layers_ready: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("blocks", "bytes", "seconds")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    seconds: float
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
