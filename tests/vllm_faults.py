"""A KVStoreConnector whose first ``KVSTORE_TEST_FAIL_LOADS`` loads fail half-way, for the
real-engine test of load failures. vLLM imports it by ``kv_connector_module_path``
(``vllm_faults``, with tests/ on PYTHONPATH); each injected failure appends a line to the file
named by ``KVSTORE_TEST_FAULT_LOG``, so the test can tell that it fired."""

from __future__ import annotations

import os

from kvstore.clients.vllm_connector import KVStoreConnector
from kvstore.clients.vllm_hybrid import HybridWorker, GroupWorker
from kvstore.clients.vllm_state import StateWorker
from kvstore.clients.vllm_worker import ConnectorWorker


class FailingCopies:
    """A load handle whose copies fail from layer ``from_layer`` on, as a dead DMA would."""

    def __init__(self, handle, from_layer: int) -> None:
        self.handle, self.from_layer = handle, from_layer
        self.blocks = handle.blocks

    def wait_layer(self, l: int, stream=None, timeout_s: float | None = None) -> None:
        if l >= self.from_layer:
            raise RuntimeError(f"injected: copy of layer {l} failed")
        self.handle.wait_layer(l, stream, timeout_s)

    def release(self) -> None:
        self.handle.release()


class FaultyLoadWorker(ConnectorWorker):
    def _load_pinned(self, path, span, lease):
        h = super()._load_pinned(path, span, lease)
        left = int(os.environ.get("KVSTORE_TEST_FAIL_LOADS", "0"))
        log = os.environ["KVSTORE_TEST_FAULT_LOG"]
        done = len(open(log).read().splitlines()) if os.path.exists(log) else 0
        if h is None or done >= left:
            return h
        with open(log, "a") as f:
            f.write(f"{span.req_id} blocks {span.start}-{span.end}\n")
        return FailingCopies(h, self.layout.num_layers // 2)


class FaultyLoadConnector(KVStoreConnector):
    worker_class = FaultyLoadWorker


class RecordingHybridWorker(HybridWorker):
    """Writes each group's load span to ``KVSTORE_TEST_LOAD_LOG`` (``req group start end``);
    loads of a prompt starting with ``KVSTORE_TEST_FAIL_PREFIX`` (comma-separated token ids)
    fail in group ``KVSTORE_TEST_FAIL_GROUP``, as a lost copy would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        fail = [int(t) for t in os.environ.get("KVSTORE_TEST_FAIL_PREFIX", "").split(",") if t]
        sub = self.subs[int(os.environ.get("KVSTORE_TEST_FAIL_GROUP", "0"))]
        load = sub._load_pinned

        def load_or_fail(path, span, lease):
            if fail and span.token_ids[:len(fail)] == fail:
                lease.release()
                with open(os.environ["KVSTORE_TEST_LOAD_LOG"], "a") as f:
                    f.write(f"{span.req_id} failed\n")
                raise RuntimeError(f"injected: the copy of {span.req_id} failed")
            return load(path, span, lease)

        sub._load_pinned = load_or_fail

    def start_load_kv(self, meta) -> None:
        for g, part in enumerate(self._split(meta)):
            for span in part.pulls:
                with open(os.environ["KVSTORE_TEST_LOAD_LOG"], "a") as f:
                    f.write(f"{span.req_id} {g} {span.start} {span.end}\n")
        super().start_load_kv(meta)


class RecordingHybridConnector(KVStoreConnector):
    hybrid_worker_class = RecordingHybridWorker


class FaultyStateWorker(StateWorker):
    """A state group's worker whose loads of a prompt starting with
    ``KVSTORE_TEST_FAIL_PREFIX`` fail (as a lost copy would), and whose loads of one starting
    with ``KVSTORE_TEST_SPOIL_PREFIX`` put a zeroed state into vLLM's block instead of the
    snapshot (what a connector that restored the wrong state would do); each writes a line to
    ``KVSTORE_TEST_LOAD_LOG``."""

    def _write(self, block_id: int, src) -> None:
        if self._prefix("KVSTORE_TEST_SPOIL_PREFIX"):
            self._log("spoiled")
            src = src * 0
        super()._write(block_id, src)

    def _load(self, span) -> bool:
        self._span = span
        if self._prefix("KVSTORE_TEST_FAIL_PREFIX"):
            self._log("failed")
            raise RuntimeError(f"injected: the state copy of {span.req_id} failed")
        return super()._load(span)

    def _prefix(self, var: str) -> bool:
        want = [int(t) for t in os.environ.get(var, "").split(",") if t]
        return bool(want) and self._span.token_ids[:len(want)] == want and self.layers == self._target()

    def _target(self) -> tuple[str, ...]:
        return tuple(os.environ.get("KVSTORE_TEST_FAULT_LAYERS", "").split(","))

    def _log(self, what: str) -> None:
        with open(os.environ["KVSTORE_TEST_LOAD_LOG"], "a") as f:
            f.write(f"{self._span.req_id} state {what}\n")


class FaultyStateHybridWorker(HybridWorker):
    state_worker_class = FaultyStateWorker


class FaultyStateConnector(KVStoreConnector):
    hybrid_worker_class = FaultyStateHybridWorker


class FailingSaveGroupWorker(GroupWorker):
    """A token-row group's worker whose saves of a prompt starting with
    ``KVSTORE_TEST_FAIL_SAVE_PREFIX`` fail when it holds layer ``KVSTORE_TEST_FAIL_SAVE_LAYER``
    (as a Reserve the daemon refused would), each writing a line to ``KVSTORE_TEST_LOAD_LOG``."""

    def _begin_saves(self, meta):
        saves = super()._begin_saves(meta)
        want = [int(t) for t in os.environ.get("KVSTORE_TEST_FAIL_SAVE_PREFIX", "").split(",") if t]
        if not want or os.environ.get("KVSTORE_TEST_FAIL_SAVE_LAYER") not in self._layer_index:
            return saves
        keep = []
        for span, h in saves:
            if span.token_ids[:len(want)] != want:
                keep.append((span, h))
                continue
            h.abort()
            self._save_failed(span)
            with open(os.environ["KVSTORE_TEST_LOAD_LOG"], "a") as f:
                f.write(f"{span.req_id} save failed\n")
        saves[:] = keep
        return saves


class FailingSaveHybridWorker(HybridWorker):
    group_worker_class = FailingSaveGroupWorker


class FailingSaveConnector(KVStoreConnector):
    hybrid_worker_class = FailingSaveHybridWorker
