"""The daemon's parts; the shared vocabulary (layout, keys, config, errors, policy) is one level
up in :mod:`kvstore`, and the tiers and the wire are :mod:`kvstore.tiers` and
:mod:`kvstore.transport`. Read in this order (docs/architecture.md has the picture):

1. :mod:`.main`: the composition root. Builds every part from a Config and starts it.
2. :mod:`.service`: the gRPC servicer. Validates a request, takes the core lock, calls the core.
3. :mod:`.core`: namespaces, sessions (:mod:`.sessions`), the block index (:mod:`.index`),
   leases and DRAM eviction. Single-threaded under ``Core.lock``.
4. :mod:`.tiering`: DRAM <-> NVMe (demoter, promotion, prefetch, recovery, durable commit).
5. :mod:`.hbm_cache`: copies of hot DRAM blocks in the HBM pool.
6. :mod:`.outbound` (the Transfer RPC: ship blocks to a peer) and :mod:`.inbound` (the transfer
   listener and AwaitTransfer), both over :mod:`kvstore.transport`.
7. :mod:`.handout` (the arena over a unix socket), :mod:`.stats` and :mod:`.metrics` (Stats and
   /metrics), :mod:`.advice` (load-or-recompute). The per-layer doorbell cells, shared with clients, are
   :mod:`kvstore.doorbell`.
8. :mod:`.pull` (kvstore.v1.Peer: a prefix pulled from the peer that holds it), over the fleet's
   membership on etcd in :mod:`kvstore.cluster` (docs/cluster.md); :mod:`.remote` (a Lookup's
   remote hits, the per-peer link estimates, and the load / pull / recompute advice).
9. :mod:`.events`: the KV event stream (vLLM's format, :mod:`kvstore.kv_events`) the core reports
   tier changes to; peers read it into their cluster directory (:mod:`kvstore.cluster`).
"""
