"""kvstore across nodes: the cluster prefix directory fed by the peers' KV event streams."""
