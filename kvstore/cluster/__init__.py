"""The daemon in a fleet: membership on etcd (:mod:`.membership`, records in :mod:`.member`),
over a small client of etcd's v3 gRPC API (:mod:`.etcd`), and the cluster prefix directory fed
by the peers' KV event streams (:mod:`.directory`, :mod:`.stream`). docs/cluster.md has the
picture."""
