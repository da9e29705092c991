"""``kvstore serve`` whose transfer sender corrupts one chunk on the wire: the real daemon, in its
own process, for the integrity tests. The fault comes in through a subclass, not through a switch
in the product.

    python tests/faulty_daemon.py --corrupt-frame N serve [kvstore serve flags...]

flips one byte in the middle of the N-th CHUNK frame (a layer or a run of layers; counted from 1
over every transfer the daemon sends) after its checksum was taken from the source.
"""

from __future__ import annotations

import sys

from kvstore.app.cli import build_parser, cmd_serve
from kvstore.daemon.main import Daemon
from kvstore.transport import Sender


def launcher(corrupt_frame: int) -> list[str]:
    """The command that stands for ``python -m kvstore`` (see daemon_util.start_daemon)."""
    return [sys.executable, __file__, "--corrupt-frame", str(corrupt_frame)]


def flip_a_byte_of_frame(n: int):
    """A Sender tamper that flips a byte of the ``n``-th CHUNK frame it sees."""
    count = 0

    def tamper(frame, payload):
        nonlocal count
        count += 1
        if count != n:
            return payload
        bad = bytearray(payload)
        bad[len(bad) // 2] ^= 0x01
        return bytes(bad)

    return tamper


def corrupting_daemon(n: int) -> type[Daemon]:
    """Daemon whose transfer service sends through a Sender corrupting frame ``n``."""

    class CorruptingSender(Sender):
        def __init__(self, config) -> None:
            super().__init__(config, tamper=flip_a_byte_of_frame(n))

    class CorruptingDaemon(Daemon):
        transfer_sender = CorruptingSender

    return CorruptingDaemon


def main(argv: list[str]) -> int:
    if argv[:1] != ["--corrupt-frame"] or argv[2:3] != ["serve"] or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: faulty_daemon.py --corrupt-frame N serve [kvstore serve flags...] (N >= 1)", file=sys.stderr)
        return 2
    return cmd_serve(build_parser().parse_args(argv[2:]), corrupting_daemon(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
