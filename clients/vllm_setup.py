"""The vLLM connector's setup around the connector itself: its settings from
``kv_connector_extra_config``, checked (and the daemon reached) as vLLM starts; kvstore's logs
joined to vLLM's; the KV layout a TP rank holds, the stats and KV-event containers it hands
vLLM, and the link to the daemon that is re-made when the daemon goes away."""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.clients.client import KVStoreClient, KVStoreError, default_socket_path
from kvstore.keys import KV_CODECS
from kvstore.layout import DType, KVLayout
from kvstore.modelcfg import from_hf
from kvstore.tier_kind import TierKind
from kvstore.tiers.kv_copy import DEFAULT_COPY_PATH, CopyPath

log = logging.getLogger("kvstore.vllm")

UNREACHABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")  # gRPC codes of a daemon that is not there
LOST = (*UNREACHABLE, "NOT_FOUND", "CANCELLED")  # a call failing so: the session is gone (Link.lost)


# --- logs -------------------------------------------------------------------------------------

class ToVllmHandlers(logging.Handler):
    """Hands a record to the handlers vLLM's ``vllm`` logger has at the time: vLLM configures
    its logging again in each of its processes (and may in one), and kvstore follows."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def join_vllm_logging() -> None:
    """Inside vLLM, kvstore logs the way vLLM does: the ``kvstore`` logger hands its records to
    vLLM's handlers (same format, process tag, stream) at vLLM's level (so kvstore's INFO lines
    show at vLLM's default). Idempotent. Left alone where vLLM configured no logging of its own
    (``VLLM_CONFIGURE_LOGGING=0``: its logger has no handlers) or the user configured
    ``kvstore`` (handlers or a level of their own)."""
    ours, theirs = logging.getLogger("kvstore"), logging.getLogger("vllm")
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return
    ours.addHandler(ToVllmHandlers())
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # vLLM's own logger does not propagate either: no second copy at the root


CACHE_DTYPES = {"fp8": DType.FP8_E4M3, "fp8_e4m3": DType.FP8_E4M3, "fp8_e5m2": DType.FP8_E5M2}
TORCH_DTYPES = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16, torch.float16: DType.FP16}
HIT_SOURCES = {TierKind.HBM: CacheHitSource.HOST, TierKind.DRAM: CacheHitSource.HOST,
               TierKind.NVME: CacheHitSource.DISK, TierKind.REMOTE: CacheHitSource.P2P}


# --- settings ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector reads from ``kv_connector_extra_config`` (seconds, tokens/s)."""

    socket_path: str | None = None       # "kvstore_socket"; None = the daemon's default socket
    model_id: str = ""                   # "model_id"; "" = vLLM's model name
    block_tokens: int = 0                # "block_tokens"; 0 = vLLM's block_size
    tenant_salt: str = ""                # "tenant_salt"
    prefill_tokens_per_s: float = 0.0    # "prefill_tokens_per_s": this engine's measured prefill rate
    model_params: float = 0.0            # "model_params"; 0 = the daemon derives it
    follow_policy: bool = True           # "follow_policy": False loads every hit block
    load_wait_s: float = 10.0            # "load_wait_s": Acquire may wait this long for NVMe blocks
    save_timeout_s: float = 30.0         # "save_timeout_s": bound on wait_for_save
    rpc_timeout_s: float = 5.0           # "rpc_timeout_s": bound on one control call to the daemon
    reconnect_s: float = 2.0             # "reconnect_s": least time between tries to reach a lost daemon
    transfer_peer: str = ""              # "transfer_peer": host:port of a decode daemon's transfer listener
    tp_rank: int | None = None           # "tp_rank"; None = vLLM's tensor-parallel rank
    copy_path: str = DEFAULT_COPY_PATH.value  # "copy_path": zerocopy | staged | legacy (docs/gpu.md)
    pull: bool = True                    # "pull": act on a PULL advice (a peer holds more of the prefix)
    pull_timeout_s: float = 5.0          # "pull_timeout_s": deadline of one pull; past it, a miss
    ask_peers: bool = False              # "ask_peers": Lookup asks the peers too (a round trip, see docs)
    require_daemon: bool = False         # "require_daemon": an unreachable daemon fails vLLM's start
    transfer_wait_s: float = 5.0         # "transfer_wait_s": a decode waits this long for an announced transfer
    kv_codec: str = ""                   # "kv_codec": int8 | fp8 stores blocks quantized on NVMe (docs/compression.md)
    load_piece_bytes: int = 4 << 20      # "load_piece_bytes": a load from NVMe is pinned and copied in pieces of at least this size (0: whole)

    NAMES = {"kvstore_socket": "socket_path", "model_id": "model_id", "block_tokens": "block_tokens",
             "tenant_salt": "tenant_salt", "prefill_tokens_per_s": "prefill_tokens_per_s",
             "model_params": "model_params", "follow_policy": "follow_policy", "load_wait_s": "load_wait_s",
             "save_timeout_s": "save_timeout_s", "rpc_timeout_s": "rpc_timeout_s", "reconnect_s": "reconnect_s",
             "transfer_peer": "transfer_peer", "tp_rank": "tp_rank", "copy_path": "copy_path", "pull": "pull",
             "pull_timeout_s": "pull_timeout_s", "ask_peers": "ask_peers",
             "require_daemon": "require_daemon", "transfer_wait_s": "transfer_wait_s", "kv_codec": "kv_codec",
             "load_piece_bytes": "load_piece_bytes"}

    @classmethod
    def from_vllm(cls, vllm_config) -> "ConnectorSettings":
        return cls.from_extra(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None))

    @classmethod
    def from_extra(cls, extra_config: dict | None) -> "ConnectorSettings":
        """The settings of a ``kv_connector_extra_config``; ValueError naming a bad key or value."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(cls.NAMES))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r}; known: {', '.join(sorted(cls.NAMES))}")
        s = cls(**{cls.NAMES[k]: v for k, v in extra.items()})
        for name in ("load_wait_s", "save_timeout_s", "rpc_timeout_s", "reconnect_s", "pull_timeout_s",
                     "transfer_wait_s"):
            if not isinstance(getattr(s, name), (int, float)) or getattr(s, name) <= 0:
                raise ValueError(f"kv_connector_extra_config: {name} must be a positive number of seconds, "
                                 f"got {getattr(s, name)!r}")
        for name in ("follow_policy", "pull", "ask_peers", "require_daemon"):
            if not isinstance(getattr(s, name), bool):
                raise ValueError(f"kv_connector_extra_config: {name} must be true or false, got {getattr(s, name)!r}")
        if s.kv_codec not in KV_CODECS:
            raise ValueError(f"kv_connector_extra_config: kv_codec must be int8 or fp8 (lossy, opt-in) or empty, "
                             f"got {s.kv_codec!r}")
        for name in ("block_tokens", "load_piece_bytes"):
            v = getattr(s, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"kv_connector_extra_config: {name} must be an integer >= 0, got {v!r}")
        try:
            CopyPath.parse(s.copy_path)
        except ValueError as e:
            raise ValueError(f"kv_connector_extra_config: {e}") from None
        return s


# --- checked at start -------------------------------------------------------------------------

def daemon_unreachable(s: ConnectorSettings, e: KVStoreError) -> RuntimeError:
    return RuntimeError(f"kvstore: daemon not reachable at {s.socket_path or default_socket_path()} ({e}); "
                        "kv_connector_extra_config sets require_daemon, so vLLM does not start without it")


def reach_daemon(s: ConnectorSettings) -> None:
    """One control call to the daemon (at most ``rpc_timeout_s``): a daemon that does not answer
    is an error where ``require_daemon`` is set, else one warning (vLLM would run without it)."""
    c = KVStoreClient(s.socket_path, timeout_s=s.rpc_timeout_s, map_arena=False)
    try:
        c.stats()
    except KVStoreError as e:
        if e.code.name not in UNREACHABLE:
            return  # it answered: it is there
        if s.require_daemon:
            raise daemon_unreachable(s, e) from None
        log.warning("kvstore: daemon not reachable (%s); vLLM will run without it and try again every %s s",
                    e, s.reconnect_s)
    finally:
        c.close()


def vllm_config_in_check() -> VllmConfig | None:
    """The VllmConfig whose own methods (its ``__post_init__`` check) are further up this
    thread's stack, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(me := frame.f_locals.get("self"), VllmConfig):
            return me
        frame = frame.f_back
    return None


def check_on_import(module: str) -> None:
    """Check the config vLLM is starting with, at once, when ``module`` (a connector named by
    ``kv_connector_module_path``) is imported by vLLM's config check: that import, in vLLM's
    first process, is the one call into kvstore before any model loads (vLLM 0.32 builds the
    connectors after the model; on CPUs and with ``enforce_eager`` it asks the connector class
    nothing earlier). A bad key or value, or an unreachable daemon with ``require_daemon``,
    fails vLLM's start there. Elsewhere (another importer, the module already imported) the
    connector's constructor checks the same."""
    vllm_config = vllm_config_in_check()
    ktc = vllm_config.kv_transfer_config if vllm_config is not None else None
    if ktc is None or ktc.kv_connector_module_path != module:
        return
    join_vllm_logging()
    reach_daemon(ConnectorSettings.from_extra(ktc.kv_connector_extra_config))


def kv_layout(vllm_config, block_tokens: int, all_heads: bool = False) -> KVLayout:
    """The KV layout one TP rank holds (``all_heads``: the whole model's, every KV head): shape
    from the HF config, dtype from the cache dtype."""
    mc = vllm_config.model_config
    hf = mc.hf_config
    cfg = from_hf(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf), str(getattr(mc, "model", "model")))
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype == "auto":
        dt = mc.dtype
        dtype = TORCH_DTYPES.get(dt) if isinstance(dt, torch.dtype) else DType.parse(str(dt))
        if dtype is None:
            raise ValueError(f"model_config.dtype: {dt} has no kvstore KV dtype")
    elif cache_dtype in CACHE_DTYPES:
        dtype = CACHE_DTYPES[cache_dtype]
    else:
        dtype = DType.parse(cache_dtype)
    tp = 1 if all_heads else int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    return cfg.gpu_layout(dtype, tp, block_tokens)


def tp_rank(settings: ConnectorSettings) -> int:
    if settings.tp_rank is not None:
        return int(settings.tp_rank)
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized
    return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0


# --- worker -> scheduler: stats and events ----------------------------------------------------

STAT_KEYS = ("loaded_blocks", "load_failed_blocks", "saved_blocks", "save_failed_blocks", "load_s", "save_s",
             "pulled_blocks", "pull_failed_blocks")


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters of one logging interval, summed over workers (blocks, seconds)."""

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def reset(self) -> None:
        self.data = {k: 0 for k in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for k in STAT_KEYS:
            self.data[k] += other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVStoreKVEvents(LMCacheKVEvents):
    """Blocks stored into and found gone from kvstore, as vLLM KV cache events (kept when
    every worker reported them, like LMCache's)."""


# --- the connection -------------------------------------------------------------------------

class Link:
    """The client and its session, re-made when the daemon went away (at most every
    ``reconnect_s``). ``client`` is None while there is no daemon to talk to. ``map_arena``:
    the worker's link maps the daemon's arena; the scheduler's (lookups only) does not.
    ``shard``: what this TP rank writes and reads of blocks that hold the whole model's KV
    (``layout``'s): its KV heads (:class:`~kvstore.layout.HeadShard`) or its share of a
    recurrent state (:class:`~kvstore.clients.vllm_state.StateShard`); set on each client, whose
    Reserves then write that part of each block."""

    def __init__(self, settings: ConnectorSettings, layout: KVLayout, model_id: str, tp_rank: int,
                 tp_world: int, map_arena: bool = True, shard=None) -> None:
        self.settings, self.layout, self.model_id = settings, layout, model_id
        self.tp_rank, self.tp_world, self.map_arena = tp_rank, tp_world, map_arena
        self.shard = shard
        self.client: KVStoreClient | None = None
        self.generation = 0          # bumped on every new session: views into the old arena are stale
        self._next_try = 0.0
        self._retired: list[KVStoreClient] = []
        self._retired_lock = threading.Lock()  # retire may run on the worker's Reserve/Release thread
        if self.connect(raise_errors=True) is not None:
            where = f"TP rank {tp_rank} of {tp_world}" if shard is None else \
                f"part {shard.part} of {shard.parts} of each block, TP=1's namespace"
            log.info("kvstore: connected to the daemon at %s (%s, %s); session %s",
                     self.client.socket_path, model_id, where, self.client.session_id.hex()[:8])

    def connect(self, raise_errors: bool = False) -> KVStoreClient | None:
        s = self.settings
        c = KVStoreClient(s.socket_path, timeout_s=s.rpc_timeout_s, map_arena=self.map_arena)
        c.shard = self.shard
        try:
            c.register(self.layout, self.model_id, tp_rank=self.tp_rank, tp_world=self.tp_world,
                       tenant_salt=s.tenant_salt, prefill_tokens_per_s=float(s.prefill_tokens_per_s), kv_codec=s.kv_codec,
                       model_params=float(s.model_params))
        except KVStoreError as e:
            c.close()
            self._next_try = time.monotonic() + s.reconnect_s
            if raise_errors and e.code.name not in UNREACHABLE:
                raise  # a real refusal (layout too large, ...) is a configuration error
            if raise_errors and s.require_daemon:
                raise daemon_unreachable(s, e) from None
            # Said once, when the engine starts without it (or by lost()); not at every retry.
            log.log(logging.WARNING if raise_errors else logging.DEBUG,
                    "kvstore: daemon not reachable (%s); vLLM runs without it and retries every %s s", e, s.reconnect_s)
            return None
        try:
            c.warm_up()  # the first Lookup and Acquire cost their first-call price here
        except KVStoreError as e:
            log.debug("kvstore: warm-up round trip failed (the first hit pays for it): %s", e)
        self.client = c
        self.generation += 1
        return c

    def get(self) -> KVStoreClient | None:
        if self.client is None and time.monotonic() >= self._next_try:
            if self.connect() is not None:
                log.info("kvstore: daemon reached again; session %s", self.client.session_id.hex()[:8])
        return self.client

    def lost(self, e: Exception) -> None:
        """A call failed: drop the session if the daemon is gone or forgot it. Its client is
        closed (and its arena unmapped) by :meth:`retire`, at once on a side that has nothing of
        it in flight (the scheduler), after the step on the worker."""
        code = getattr(getattr(e, "code", None), "name", "")
        if code in LOST and self.client is not None:
            log.warning("kvstore: daemon lost (%s); retrying every %s s", e, self.settings.reconnect_s)
            # This step's handles still hold the client: close it once they are done (retire).
            with self._retired_lock:
                self._retired.append(self.client)
            self.client = None
            self._next_try = time.monotonic() + self.settings.reconnect_s

    def retiring(self) -> bool:
        """Whether a client dropped by :meth:`lost` waits for :meth:`retire`."""
        with self._retired_lock:
            return bool(self._retired)

    def retire(self, end_sessions: bool = True) -> None:
        """Close clients dropped by :meth:`lost`, once nothing of theirs is in flight (``end_sessions``
        False: their sessions are left to the daemon's TTL, see :meth:`KVStoreClient.close`)."""
        with self._retired_lock:
            retired, self._retired = self._retired, []
        for c in retired:
            try:
                c.close(end_session=end_sessions)
            except Exception:  # noqa: BLE001 - the daemon is gone; nothing to tell it
                pass

    def close(self) -> None:
        self.retire()
        if self.client is not None:
            self.client.close()
            self.client = None
