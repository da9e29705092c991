"""Helpers for tests of stream ordering (emulated CUDA streams and the HBM tier on them)."""

import threading

BLOCKED_S = 0.05  # how long a wait that must not finish is given to (wrongly) finish


class Gate:
    """Holds a stream at a point until opened: ``stream.submit(gate)``."""

    def __init__(self) -> None:
        self._open = threading.Event()

    def __call__(self) -> None:
        assert self._open.wait(30), "gate never opened"

    def open(self) -> None:
        self._open.set()
