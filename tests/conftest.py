import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_util import Daemons  # noqa: E402


@pytest.fixture
def daemons(tmp_path):
    """Starts real daemon processes for one test: ``d = daemons(*flags, name=..., dram=...,
    transfer=...)`` takes :func:`daemon_util.start_daemon`'s arguments, in ``tmp_path`` unless
    ``workdir`` is given. At teardown every one still running gets SIGTERM, and each one the
    test did not kill must have exited 0."""
    pool = Daemons(tmp_path)
    yield pool
    pool.stop_all()


@pytest.fixture(scope="module")
def module_daemons(tmp_path_factory):
    """:func:`daemons` shared by a module's tests (stopped and checked after its last test)."""
    pool = Daemons(tmp_path_factory.mktemp("daemons"))
    yield pool
    pool.stop_all()


@pytest.fixture(scope="module")
def module_daemon(module_daemons):
    return module_daemons()


@pytest.fixture
def daemon(request, daemons):
    """A real daemon process with a 64 MiB DRAM tier in 4 MiB extents, for this test alone; or,
    in a module that sets ``SHARE_DAEMON = True`` (its tests need no fresh daemon: each keeps to
    tokens or a namespace of its own and counts nothing daemon-wide), one for the whole module."""
    if getattr(request.module, "SHARE_DAEMON", False):
        return request.getfixturevalue("module_daemon")
    return daemons()


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
