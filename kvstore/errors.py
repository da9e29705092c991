"""Errors the core raises; the gRPC servicer maps each code to the gRPC status of that name."""

from __future__ import annotations

import enum


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
    the same request succeeds once background work (a demotion) ends, without any change."""

    def __init__(self, code: Code, message: str, transient: bool = False) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.transient = transient


def invalid(msg: str) -> KVError:
    return KVError(Code.INVALID_ARGUMENT, msg)


def not_found(msg: str) -> KVError:
    return KVError(Code.NOT_FOUND, msg)
