from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PeerLookupRequest(_message.Message):
    __slots__ = ("requester", "namespace_id", "keys")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    requester: str
    namespace_id: bytes
    keys: bytes
    def __init__(self, requester: _Optional[str] = ..., namespace_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ...) -> None: ...

class PeerLookupResponse(_message.Message):
    __slots__ = ("blocks", "tiers", "epoch")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    tiers: bytes
    epoch: int
    def __init__(self, blocks: _Optional[int] = ..., tiers: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("session_id", "keys", "holder", "deadline_s", "layer_major")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_MAJOR_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    holder: str
    deadline_s: float
    layer_major: bool
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., holder: _Optional[str] = ..., deadline_s: _Optional[float] = ..., layer_major: _Optional[bool] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("blocks", "pulled", "holder", "holder_epoch", "bytes", "detail")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    HOLDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    pulled: int
    holder: str
    holder_epoch: int
    bytes: int
    detail: str
    def __init__(self, blocks: _Optional[int] = ..., pulled: _Optional[int] = ..., holder: _Optional[str] = ..., holder_epoch: _Optional[int] = ..., bytes: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("requester", "requester_epoch", "holder_epoch", "namespace_id", "keys", "deadline_s", "layer_major")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    LAYER_MAJOR_FIELD_NUMBER: _ClassVar[int]
    requester: str
    requester_epoch: int
    holder_epoch: int
    namespace_id: bytes
    keys: bytes
    deadline_s: float
    layer_major: bool
    def __init__(self, requester: _Optional[str] = ..., requester_epoch: _Optional[int] = ..., holder_epoch: _Optional[int] = ..., namespace_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., deadline_s: _Optional[float] = ..., layer_major: _Optional[bool] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("blocks", "bytes")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
