"""The node daemon: the DRAM core plus the tiers and transport enabled by config.

Each capability is a mixin over :class:`kvstore.daemon.Daemon` hooks, so the core daemon stays
small and each tier's wiring lives next to its own concerns.
"""

from __future__ import annotations

from kvstore.daemon import Daemon


class NodeDaemon(Daemon):
    pass
