"""The daemon in a fleet: membership on etcd (:mod:`.membership`, records in :mod:`.member`),
over a small client of etcd's v3 gRPC API (:mod:`.etcd`). docs/cluster.md has the picture."""
