"""Errors the core raises; the gRPC servicer maps each code to the gRPC status of that name."""

from __future__ import annotations

import enum

from kvstore.v1 import kvstore_pb2 as pb

# Trailing metadata key naming a refusal a client acts on (a ``pb.Refusal`` value's name): the
# daemon sets it, the client reads it, neither parses the message.
REFUSAL_KEY = "kvstore-refusal"


class Code(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNAVAILABLE = "UNAVAILABLE"
    ABORTED = "ABORTED"
    DATA_LOSS = "DATA_LOSS"
    INTERNAL = "INTERNAL"


class KVError(Exception):
    """A request the daemon refuses; ``message`` tells the user what to change. ``transient``:
    the same request succeeds once background work (a demotion) ends, without any change.
    ``refusal``: a ``pb.Refusal`` the client is told about in trailing metadata (0 = none)."""

    def __init__(self, code: Code, message: str, transient: bool = False, refusal: int = 0) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.transient = transient
        self.refusal = refusal


def invalid(msg: str) -> KVError:
    return KVError(Code.INVALID_ARGUMENT, msg)


def not_found(msg: str) -> KVError:
    return KVError(Code.NOT_FOUND, msg)


def session_unknown(msg: str) -> KVError:
    return KVError(Code.NOT_FOUND, msg, refusal=pb.REFUSAL_SESSION_UNKNOWN)
