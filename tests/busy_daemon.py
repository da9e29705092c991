"""``kvstore serve`` with threads that keep the daemon's GIL busy: pure-Python loops that never
block, as a process loaded with request handling and copies would. The load comes in through a
subclass, not a switch in the product.

    python tests/busy_daemon.py --spinners N serve [kvstore serve flags...]
"""

from __future__ import annotations

import sys
import threading

from kvstore.app.cli import build_parser, cmd_serve
from kvstore.daemon.main import Daemon


def launcher(spinners: int) -> list[str]:
    """The command that stands for ``python -m kvstore`` (see daemon_util.spawn)."""
    return [sys.executable, __file__, "--spinners", str(spinners)]


def busy_daemon(spinners: int) -> type[Daemon]:
    class BusyDaemon(Daemon):
        def start(self) -> None:
            super().start()
            for i in range(spinners):
                threading.Thread(target=self._spin, name=f"spinner-{i}", daemon=True).start()

        def _spin(self) -> None:
            n = 0
            while not self.stopping.is_set():
                for _ in range(10_000):  # holds the GIL but for the interpreter's switch interval
                    n += 1

    return BusyDaemon


def main(argv: list[str]) -> int:
    if argv[:1] != ["--spinners"] or argv[2:3] != ["serve"] or not argv[1].isdigit():
        print("usage: busy_daemon.py --spinners N serve [kvstore serve flags...]", file=sys.stderr)
        return 2
    return cmd_serve(build_parser().parse_args(argv[2:]), busy_daemon(int(argv[1])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
