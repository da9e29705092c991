import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_util import start_daemon  # noqa: E402


@pytest.fixture
def daemon(tmp_path):
    """A real daemon process with a 64 MiB DRAM tier in 4 MiB extents."""
    d = start_daemon(tmp_path)
    yield d
    rc = d.stop()
    assert rc == 0, f"daemon exited with {rc} on SIGTERM:\n{d.log()}"


@pytest.fixture
def client_factory(daemon):
    from kvstore.clients import KVStoreClient

    made = []

    def make(layout=None, model_id="test-model", **kw):
        from kvstore.layout import KVLayout

        c = KVStoreClient(daemon.socket_path, timeout_s=10)
        c.register(layout or KVLayout(4, 2, 64, "fp16"), model_id, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
