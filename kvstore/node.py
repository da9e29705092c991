"""The node daemon: the DRAM core plus the NVMe tier and the transfer listener when configured.

:class:`kvstore.daemon.Daemon` owns the core and gRPC; this class fills its hooks with tier
movement (:mod:`kvstore.tiering`) so the base daemon stays small.
"""

from __future__ import annotations

import logging

from kvstore.daemon import Daemon
from kvstore.errors import Code, KVError
from kvstore.tiers.base import TierKind, TierStats

log = logging.getLogger("kvstore.node")


class NodeDaemon(Daemon):
    tiering = None
    nvme_error = ""
    hbm = None

    transfers = None

    def start_extras(self) -> None:
        self._start_hbm()
        self._start_nvme()
        if self.cfg.transport.listen:
            from kvstore.transfer import TransferService

            try:
                self.transfers = TransferService(self)
                self.transfer_address = self.transfers.start()
            except Exception as e:  # noqa: BLE001 - a bad listen address or missing UCX stops start-up
                from kvstore.daemon import StartupError

                raise StartupError(f"transport.listen: cannot start the {self.cfg.transport.backend} "
                                   f"listener on {self.cfg.transport.listen}: {e}") from None

    def _start_hbm(self) -> None:
        if not self.cfg.hbm.capacity_bytes:
            return
        from kvstore.tiers.base import TierError
        from kvstore.tiers.hbm import HbmTier, HbmTierConfig

        try:
            self.hbm = HbmTier(HbmTierConfig.from_config(self.cfg))
        except (TierError, RuntimeError, ValueError) as e:
            from kvstore.daemon import StartupError

            raise StartupError(f"hbm: {e}") from None
        self.hbm.register_host(self.arena)
        self.hbm_emulated = self.hbm.emulated  # labels kvstore_info and every stats answer
        from kvstore.hbm_cache import HbmCache

        self.hbm_cache = HbmCache(self, self.hbm)
        self.hbm_cache.start()
        st = self.hbm.stats()
        log.info("HBM tier: %.2f GiB on %s", st.capacity_bytes / 2**30,
                 "an EMULATED device (" + st.extra.get("reason", "") + ")" if self.hbm.emulated else "the GPU")

    def _start_nvme(self) -> None:
        n = self.cfg.nvme
        if not n.dir:
            return
        from kvstore.tiering import Tiering
        from kvstore.tiers.nvme import NvmeError, NvmeTier, NvmeTierConfig

        extent = self.cfg.dram.extent_bytes
        cap = n.capacity_bytes // extent * extent
        file_bytes = max(extent, min(n.file_bytes, cap) // extent * extent)
        try:
            tier = NvmeTier(NvmeTierConfig(dir=n.dir, capacity_bytes=cap, file_bytes=file_bytes, extent_bytes=extent,
                                           io_threads=n.io_threads, coalesce_bytes=n.coalesce_bytes),
                            metrics=self.metrics)
        except (NvmeError, OSError, ValueError) as e:
            # The daemon keeps serving from DRAM; stats and metrics show the tier disabled and why.
            self.nvme_error = f"nvme.dir: {e}"
            log.error("NVMe tier disabled: %s", self.nvme_error)
            return
        self.tiering = Tiering(self, tier)
        blocks = self.tiering.recover()
        log.info("NVMe tier at %s: %d blocks recovered (%s I/O)", n.dir, blocks, tier.io_mode.value)
        self.tiering.start()

    def stop_extras(self, grace_s: float) -> None:
        if self.transfers is not None:
            self.transfers.stop(grace_s)
        if self.tiering is not None:
            self.tiering.close(grace_s)
        if self.hbm is not None:
            self.hbm_cache.close()
            self.hbm.close()

    def tier_stats(self) -> list[TierStats]:
        out = super().tier_stats()
        if self.hbm is not None:
            st = self.hbm.stats()
            st.extra = {"reason": st.extra.get("reason", "")} if st.emulated else {}
            out.insert(0, st)
        if self.tiering is not None:
            st = self.tiering.nvme.stats()
            if not st.enabled:
                st.extra = {"reason": st.extra.get("disabled_reason", "")}
            else:
                st.extra = {}
            out.append(st)
        elif self.cfg.nvme.dir:
            out.append(TierStats(TierKind.NVME, 0, 0, 0, enabled=False, extra={"reason": self.nvme_error}))
        return out

    # --- hooks ------------------------------------------------------------------------------
    def on_register(self, session) -> None:
        super().on_register(session)
        if self.tiering is not None:
            try:
                self.tiering.remember(session.ns)
            except OSError as e:
                log.error("cannot record namespace for NVMe recovery: %s", e)

    def hbm_handout(self, conn) -> None:
        if self.hbm is not None:
            self.hbm_cache.handout(conn)

    @property
    def durable_commit(self) -> bool:
        return self.tiering is not None and self.tiering.nvme.enabled and self.cfg.nvme.durable_commit

    def after_commit(self, blocks) -> None:
        t = self.tiering
        if t is None:
            return
        if self.cfg.nvme.durable_commit:
            t.persist(blocks)
        t.kick.set()

    def make_resident(self, session, keys, wait_s: float) -> None:
        if self.tiering is not None:
            self.tiering.make_resident(session, keys, wait_s)

    def prefetch(self, session, keys, target: TierKind, deadline_s: float) -> int:
        if target is not TierKind.DRAM:
            raise KVError(Code.INVALID_ARGUMENT, f"target: prefetch into {target.name} is not supported; use TIER_DRAM")
        if self.tiering is None:
            return super().prefetch(session, keys, target, deadline_s)
        return self.tiering.prefetch(session, keys, deadline_s)

    def transfer(self, session, keys, peer: str, deadline_s: float, pipelined: bool, lease_id: int = 0):
        if self.transfers is None:
            return super().transfer(session, keys, peer, deadline_s, pipelined)
        return self.transfers.transfer(session, keys, peer, deadline_s, pipelined, lease_id)

    def await_transfer(self, session, keys, wait_s: float):
        if self.transfers is None:
            return super().await_transfer(session, keys, wait_s)
        return self.transfers.await_transfer(session, keys, wait_s)

    def prefetch_status(self, session, handle: int, wait_s: float):
        if self.tiering is None:
            return super().prefetch_status(session, handle, wait_s)
        return self.tiering.prefetch_status(session, handle, wait_s)
