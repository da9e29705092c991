"""The Redis-protocol store of the cluster directory (:mod:`kvstore.cluster.redis_directory`):
its client, made from ``[cluster]``'s ``redis_*`` keys, and the two scripts the directory runs
on the servers."""

from __future__ import annotations

from kvstore.config import ClusterConfig

# The hashes of a stretch's blocks in order, per node the values of its run from the first block,
# stopping once no node's run goes on: {node, "e:b,e:b,...", ...}. ARGV[1]: the names' common
# part (prefix and tag), ARGV[2]: the blocks' 32-byte keys, packed (one argument: packing 64 names
# one by one cost redis-py more than the server's whole read). KEYS[1], the first name, routes
# the call; the others are in its slot (one hash tag), so the cluster serves them.
READ = """
local stem, packed = ARGV[1], ARGV[2]
local runs, order = {}, {}
for i = 0, #packed / 32 - 1 do
  local h = redis.call('HGETALL', stem .. string.sub(packed, i * 32 + 1, i * 32 + 32))
  local alive = 0
  for j = 1, #h, 2 do
    local node, r = h[j], runs[h[j]]
    if i == 0 then
      runs[node] = {h[j + 1]}
      order[#order + 1] = node
      alive = alive + 1
    elseif r and #r == i then
      r[i + 1] = h[j + 1]
      alive = alive + 1
    end
  end
  if alive == 0 then break end
end
local out = {}
for _, node in ipairs(order) do
  out[#out + 1] = node
  out[#out + 1] = table.concat(runs[node], ",")
end
return out
"""
# Delete node ARGV[1]'s field of KEYS[1] if its epoch is at most ARGV[2] (a newer write stays).
DROP_OLD = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then
  local e = tonumber(string.match(v, '^(%d+):'))
  if e and e <= tonumber(ARGV[2]) then return redis.call('HDEL', KEYS[1], ARGV[1]) end
end
return 0
"""

def connect(cfg: ClusterConfig, password: str | None, timeout_s: float):
    """A cluster-aware client (``redis`` on PyPI) to ``cfg.redis_nodes``; it learns the slots
    from the first node that answers. Commands are not retried (the caller decides); after a
    moved slot or a node lost, redis-py refreshes its slot map on the next command, inline."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    nodes = []
    for hp in cfg.redis_nodes_list():
        host, _, port = hp.rpartition(":")
        nodes.append(ClusterNode(host.strip("[]"), int(port)))
    kw: dict = {}
    if cfg.redis_tls or cfg.redis_ca_file:
        # A private CA (redis_ca_file) is the trust boundary, and nodes are dialled by the address
        # the cluster reports, so their names are not checked; against the system's public CAs
        # they must be (any holder of a public certificate would pass otherwise).
        kw.update(ssl=True, ssl_cert_reqs="required", ssl_ca_certs=cfg.redis_ca_file or None,
                  ssl_certfile=cfg.redis_cert_file or None, ssl_keyfile=cfg.redis_key_file or None,
                  ssl_check_hostname=not cfg.redis_ca_file)
    return RedisCluster(startup_nodes=nodes, username=cfg.redis_username or None, password=password,
                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                        require_full_coverage=False, decode_responses=False, **kw)


def read_password(cfg: ClusterConfig) -> str | None:
    """The ACL password from ``cluster.redis_password_file`` (a private file; ValueError naming
    the key otherwise, never holding the password); None without one. The TLS files are checked
    too, each a regular file opened without blocking: the client opens them again on its own
    thread, where a FIFO would hang it."""
    from transport.auth import read_regular, read_secret

    for key in ("redis_ca_file", "redis_cert_file", "redis_key_file"):
        if getattr(cfg, key):
            read_regular(getattr(cfg, key), f"cluster.{key}")
    if not cfg.redis_password_file:
        return None
    return read_secret(cfg.redis_password_file, "cluster.redis_password_file").decode()


def close_client(client) -> None:
    if client is not None:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a client of a dead store
            pass
