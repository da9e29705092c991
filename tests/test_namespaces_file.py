"""namespaces.json (what NVMe recovery needs to describe each namespace) under concurrent
Registers: every namespace written, the file always whole, no temporary file left behind."""

import json
import threading

from kvstore.config import Config
from kvstore.daemon.core import Core, CoreConfig
from kvstore.daemon.metrics import Metrics
from kvstore.daemon.tiering import NvmeCopies, Tiering
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.policy import LoadPolicy
from kvstore.tiers.arena import Arena
from kvstore.tiers.dram import DramTier
from kvstore.tiers.nvme import NvmeTier, NvmeTierConfig

EXTENT = 1 << 20


def test_concurrent_registers_write_every_namespace_and_a_whole_file(tmp_path):
    cfg = Config()
    arena = Arena(4 * EXTENT, prefault=False)
    nvme = NvmeTier(NvmeTierConfig(dir=str(tmp_path / "nvme"), capacity_bytes=8 * EXTENT, file_bytes=8 * EXTENT,
                                   extent_bytes=EXTENT), metrics=Metrics())
    try:
        core = Core(DramTier(arena, EXTENT), CoreConfig())
        tiering = Tiering(core.residency, NvmeCopies(nvme, cfg.nvme), cfg.nvme, cfg.dram, metrics=Metrics(), policy=LoadPolicy())
        layout = KVLayout(2, 1, 64, "fp16", block_tokens=16)
        for trial in range(20):
            states = [core.ns_state(Namespace(f"m{trial}", layout, rank, 8)) for rank in range(8)]  # a TP=8 engine
            go = threading.Barrier(len(states))
            errors = []

            def register(st):
                go.wait()
                try:
                    tiering.remember(st)
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)

            threads = [threading.Thread(target=register, args=(st,)) for st in states]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert errors == []
            on_disk = json.loads((tmp_path / "nvme" / "namespaces.json").read_text())
            assert {st.id.hex() for st in states} <= set(on_disk)
            assert all(Namespace.from_dict(on_disk[st.id.hex()]).root == st.id for st in states)
        assert len(on_disk) == 20 * 8
        assert not list((tmp_path / "nvme").glob("namespaces.*.tmp"))
    finally:
        nvme.close()
        arena.close()
