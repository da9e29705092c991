"""The vLLM KV connector driven with vLLM-shaped inputs against a real daemon.

vLLM is not installable here, so minimal stand-ins mirror the shapes the connector reads:
``Request``, ``KVCacheBlocks``, the scheduler output (new and cached request data), the
forward context, and the config objects. An ``Engine`` plays vLLM's model runner around the
worker-side connector: per-layer paged caches ``[2, num_blocks, block_size, kv_heads,
head_dim]``, block tables, and the hook order of one forward (start_load_kv, then per layer
wait_for_layer_load -> attention writes this step's KV -> save_kv_layer, then wait_for_save).
The KV the "attention" writes is the real KV of a tiny Llama (HF), so the loaded blocks can be
fed back to the model: greedy generation from them must equal plain generation."""

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip("transformers")
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from kvstore.clients import KVStoreClient  # noqa: E402
from kvstore.clients.vllm_connector import KVConnectorRole, KVStoreConnector, kv_layout  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import build_llama, plain_generate, random_tokens  # noqa: E402

BS = 16                 # vLLM block_size (and kvstore block_tokens)
NUM_BLOCKS = 24         # paged cache blocks per layer
VOCAB = 512
SYSTEM = random_tokens(100, seed=21, vocab=VOCAB)
TURN_A = random_tokens(13, seed=22, vocab=VOCAB)  # 113 tokens: 7 full blocks + 1
TURN_B = random_tokens(21, seed=23, vocab=VOCAB)  # 121 tokens: 7 full blocks + 9
SENTINEL = -7.0


# --- vLLM stand-ins ---------------------------------------------------------------------------

@dataclass
class ModelConfig:
    hf_config: object
    dtype: torch.dtype
    model: str = "tiny-llama"


@dataclass
class CacheConfig:
    block_size: int = BS
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class KVTransferConfig:
    kv_connector: str = "KVStoreConnector"
    kv_role: str = "kv_both"
    kv_connector_module_path: str = "kvstore.clients.vllm_connector"
    kv_connector_extra_config: dict = field(default_factory=dict)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class VllmConfig:
    model_config: ModelConfig
    kv_transfer_config: KVTransferConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list


@dataclass
class KVCacheBlocks:
    blocks: tuple

    def get_block_ids(self):
        return self.blocks


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list
    block_ids: tuple
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_ids: list = field(default_factory=list)
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list = field(default_factory=list)
    resumed_req_ids: set = field(default_factory=set)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list
    num_scheduled_tokens: dict
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    finished_req_ids: set = field(default_factory=set)


@dataclass
class AttentionLayer:
    kv_cache: list


@dataclass
class ForwardContext:
    no_compile_layers: dict
    attn_metadata: dict
    virtual_engine: int = 0


# --- helpers ----------------------------------------------------------------------------------

def vllm_config(model, socket_path, role="kv_both", **extra):
    extra = {"kvstore_socket": socket_path, "model_id": "tiny-llama-seed0", "prefill_tokens_per_s": 50.0, **extra}
    return VllmConfig(ModelConfig(model.config, next(model.parameters()).dtype),
                      KVTransferConfig(kv_role=role, kv_connector_extra_config=extra))


@torch.no_grad()
def reference_kv(model, ids):
    """Per layer (K, V), each ``[kv_heads, tokens, head_dim]``: what attention writes."""
    c = DynamicCache()
    model(torch.tensor([ids]), past_key_values=c, use_cache=True)
    return [(c.layers[l].keys[0], c.layers[l].values[0]) for l in range(len(c.layers))]


class Engine:
    """vLLM's model runner around the worker-side connector (see module docstring)."""

    def __init__(self, cfg, model):
        self.worker = KVStoreConnector(cfg, KVConnectorRole.WORKER)
        mc = model.config
        H, D = mc.num_key_value_heads, mc.hidden_size // mc.num_attention_heads
        dtype = next(model.parameters()).dtype
        self.names = [f"model.layers.{l}.self_attn.attn" for l in range(mc.num_hidden_layers)]
        self.caches = {n: torch.full((2, NUM_BLOCKS, BS, H, D), SENTINEL, dtype=dtype) for n in self.names}
        self.worker.register_kv_caches(self.caches)

    @staticmethod
    def rows(table, start, end):
        t = torch.arange(start, end)
        return torch.tensor(table)[t // BS] * BS + t % BS

    def step(self, meta, writes):
        """One forward: ``writes`` are (block_table, reference_kv, first, end) token ranges the
        attention computes in this step."""
        w = self.worker
        w.bind_connector_metadata(meta)
        fc = ForwardContext({n: AttentionLayer([self.caches[n]]) for n in self.names}, {})
        w.start_load_kv(fc)
        for l, name in enumerate(self.names):
            w.wait_for_layer_load(name)
            flat = self.caches[name].view(2, NUM_BLOCKS * BS, *self.caches[name].shape[3:])
            for table, kv, s, e in writes:
                r = self.rows(table, s, e)
                flat[0, r] = kv[l][0][:, s:e].transpose(0, 1)
                flat[1, r] = kv[l][1][:, s:e].transpose(0, 1)
            w.save_kv_layer(name, self.caches[name], {})
        w.wait_for_save()
        w.clear_connector_metadata()

    def gather(self, table, n):
        """The request's first ``n`` tokens of KV as HF layers ``[1, heads, n, dim]``."""
        out = []
        for name in self.names:
            flat = self.caches[name].view(2, NUM_BLOCKS * BS, *self.caches[name].shape[3:])
            r = self.rows(table, 0, n)
            out.append((flat[0, r].transpose(0, 1)[None].contiguous(), flat[1, r].transpose(0, 1)[None].contiguous()))
        return out

    def close(self):
        self.worker.shutdown()


def new_req(req_id, prompt, table, computed, scheduled):
    return SchedulerOutput([NewRequestData(req_id, prompt, (table,), computed)], {req_id: scheduled})


@torch.no_grad()
def generate_from(model, prompt, layers_kv, n_loaded, max_new_tokens):
    """Greedy HF generation on top of ``n_loaded`` tokens of KV taken from the paged cache."""
    c = DynamicCache()
    for l, (k, v) in enumerate(layers_kv):
        c.update(k[:, :, :n_loaded], v[:, :, :n_loaded], l)
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=c, max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def models():
    return {dt: build_llama("tiny", dt, seed=0) for dt in ("fp32", "bf16")}


@contextmanager
def connector(model, socket_path):
    """A scheduler-side connector and a worker-side engine on one vLLM config; both closed after."""
    cfg = vllm_config(model, socket_path)
    sched = KVStoreConnector(cfg, KVConnectorRole.SCHEDULER)
    eng = Engine(cfg, model)
    try:
        yield sched, eng
    finally:
        eng.close()
        sched.shutdown()


def producer_run(model, socket_path, prompt, table, req_id="A"):
    """A producer engine prefills ``prompt`` in one step and saves its full blocks."""
    with connector(model, socket_path) as (sched, eng):
        assert sched.get_num_new_matched_tokens(Request(req_id, prompt), 0) == (0, False)
        sched.update_state_after_alloc(Request(req_id, prompt), KVCacheBlocks((table,)), 0)
        meta = sched.build_connector_meta(new_req(req_id, prompt, table, 0, len(prompt)))
        assert not meta.loads and [(s.start, s.end) for s in meta.saves] == [(0, len(prompt) // BS)]
        kv = reference_kv(model, prompt)
        eng.step(meta, [(table, kv, 0, len(prompt))])
        assert sched.request_finished(Request(req_id, prompt), table) == (False, None)
        return kv


# --- tests ------------------------------------------------------------------------------------

def test_layout_from_vllm_config(models, daemon):
    lay = kv_layout(vllm_config(models["bf16"], daemon.socket_path), BS)
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype.label, lay.block_tokens) == (4, 2, 32, "bf16", BS)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_save_then_load_matches_plain_generation(daemon, models, dtype):
    model = models[dtype]
    prompt_a, prompt_b = SYSTEM + TURN_A, SYSTEM + TURN_B
    kv_a = producer_run(model, daemon.socket_path, prompt_a, list(range(8)))
    probe = KVStoreClient(daemon.socket_path)
    probe.register(kv_layout(vllm_config(model, daemon.socket_path), BS), "tiny-llama-seed0")
    assert probe.lookup(prompt_a) == 112
    probe.close()

    # A second engine (its own paged cache, other physical blocks) serves the same system prompt.
    table = [23, 5, 17, 2, 11, 8, 20, 14]  # 8 blocks for 121 tokens
    with connector(model, daemon.socket_path) as (sched, eng):
        req = Request("B", prompt_b)
        assert sched.get_num_new_matched_tokens(req, 0) == (96, False)  # 6 shared blocks
        sched.update_state_after_alloc(req, KVCacheBlocks((table,)), 96)
        meta = sched.build_connector_meta(new_req("B", prompt_b, table, 96, len(prompt_b) - 96))
        assert [(s.start, s.end, s.block_table) for s in meta.loads] == [(0, 6, table)]
        assert [(s.start, s.end) for s in meta.saves] == [(6, 7)]  # TURN_B's first full block
        kv_b = reference_kv(model, prompt_b)
        eng.step(meta, [(table, kv_b, 96, len(prompt_b))])  # attention computes tokens 96.. only

        loaded = eng.gather(table, 96)
        for l, (k, v) in enumerate(loaded):  # exactly the bytes engine A saved
            assert torch.equal(k[0], kv_a[l][0][:, :96]) and torch.equal(v[0], kv_a[l][1][:, :96])
        untouched = [b for b in range(NUM_BLOCKS) if b not in table]
        assert all((eng.caches[n][:, untouched] == SENTINEL).all() for n in eng.names)
        assert generate_from(model, prompt_b, loaded, 96, 10) == plain_generate(model, prompt_b, 10)
        # the block saved in this step is now a hit as well
        assert sched.get_num_new_matched_tokens(Request("C", prompt_b), 0) == (112, False)


def test_local_prefix_hit_loads_only_the_remaining_blocks(daemon, models):
    model = models["fp32"]
    prompt = SYSTEM + TURN_B
    kv_a = producer_run(model, daemon.socket_path, SYSTEM + TURN_A, list(range(8)))
    table = list(range(10, 18))
    with connector(model, daemon.socket_path) as (sched, eng):
        # vLLM's own prefix cache already holds the first 2 blocks (32 tokens).
        assert sched.get_num_new_matched_tokens(Request("B", prompt), 32) == (64, False)
        sched.update_state_after_alloc(Request("B", prompt), KVCacheBlocks((table,)), 64)
        meta = sched.build_connector_meta(new_req("B", prompt, table, 96, len(prompt) - 96))
        assert [(s.start, s.end) for s in meta.loads] == [(2, 6)]
        eng.step(meta, [(table, reference_kv(model, prompt), 96, len(prompt))])
        loaded = eng.gather(table, 96)
        for l, n in enumerate(eng.names):
            assert (eng.caches[n][:, table[:2]] == SENTINEL).all()  # local blocks not overwritten
            assert torch.equal(loaded[l][0][0, :, 32:], kv_a[l][0][:, 32:96])  # blocks 2..5 loaded
        # A misaligned local hit cannot continue a kvstore block: nothing to load.
        assert sched.get_num_new_matched_tokens(Request("D", prompt), 40) == (0, False)


def test_chunked_prefill_saves_blocks_as_they_fill(daemon, models):
    model = models["fp32"]
    prompt = SYSTEM + TURN_A  # 113 tokens
    kv = reference_kv(model, prompt)
    with connector(model, daemon.socket_path) as (sched, eng):
        assert sched.get_num_new_matched_tokens(Request("A", prompt), 0) == (0, False)
        m1 = sched.build_connector_meta(new_req("A", prompt, list(range(5)), 0, 70))  # chunk 1: 70 tokens
        assert [(s.start, s.end) for s in m1.saves] == [(0, 4)]
        eng.step(m1, [(list(range(5)), kv, 0, 70)])
        out2 = SchedulerOutput([], {"A": 43}, CachedRequestData(["A"], [([5, 6, 7],)], [70]))
        m2 = sched.build_connector_meta(out2)  # chunk 2 completes the prompt
        assert [(s.start, s.end, s.block_table) for s in m2.saves] == [(4, 7, list(range(8)))]
        eng.step(m2, [(list(range(8)), kv, 70, 113)])
        assert sched.get_num_new_matched_tokens(Request("X", prompt), 0) == (112, False)
        # decode steps fill no prompt block: nothing more to save
        out3 = SchedulerOutput([], {"A": 1}, CachedRequestData(["A"], [None], [113]))
        assert not sched.build_connector_meta(out3).saves


def test_preempted_request_reloads_into_its_new_blocks(daemon, models):
    model = models["fp32"]
    prompt = SYSTEM + TURN_B
    kv_a = producer_run(model, daemon.socket_path, SYSTEM + TURN_A, list(range(8)))
    with connector(model, daemon.socket_path) as (sched, eng):
        first = list(range(8))
        assert sched.get_num_new_matched_tokens(Request("B", prompt), 0) == (96, False)
        sched.update_state_after_alloc(Request("B", prompt), KVCacheBlocks((first,)), 96)
        eng.step(sched.build_connector_meta(new_req("B", prompt, first, 96, 25)),
                 [(first, reference_kv(model, prompt), 96, len(prompt))])
        # Preempted (its blocks freed), then resumed with a new block table: load again.
        table = list(range(16, 24))
        assert sched.get_num_new_matched_tokens(Request("B", prompt), 0) == (112, False)
        sched.update_state_after_alloc(Request("B", prompt), KVCacheBlocks((table,)), 112)
        out = SchedulerOutput([], {"B": len(prompt) - 112},
                              CachedRequestData(["B"], [(table,)], [112], resumed_req_ids={"B"}))
        meta = sched.build_connector_meta(out)
        assert [(s.start, s.end, s.block_table) for s in meta.loads] == [(0, 7, table)] and not meta.saves
        eng.step(meta, [])
        loaded = eng.gather(table, 96)
        assert all(torch.equal(loaded[l][0][0], kv_a[l][0][:, :96]) for l in range(len(eng.names)))


def test_policy_recompute_answer_loads_nothing(daemon, models):
    model = models["fp32"]
    producer_run(model, daemon.socket_path, SYSTEM + TURN_A, list(range(8)))
    fast = KVStoreConnector(vllm_config(model, daemon.socket_path, prefill_tokens_per_s=1e12),
                            KVConnectorRole.SCHEDULER)
    follow_off = KVStoreConnector(vllm_config(model, daemon.socket_path, prefill_tokens_per_s=1e12,
                                              follow_policy=False), KVConnectorRole.SCHEDULER)
    try:
        assert fast.get_num_new_matched_tokens(Request("B", SYSTEM + TURN_B), 0) == (0, False)
        assert follow_off.get_num_new_matched_tokens(Request("B", SYSTEM + TURN_B), 0) == (96, False)
    finally:
        fast.shutdown()
        follow_off.shutdown()


def test_blocks_evicted_before_the_load_are_reported(daemon, models):
    model = models["fp32"]
    prompt = SYSTEM + TURN_B
    producer_run(model, daemon.socket_path, SYSTEM + TURN_A, list(range(8)))
    table = list(range(8, 16))
    with connector(model, daemon.socket_path) as (sched, eng):
        assert sched.get_num_new_matched_tokens(Request("B", prompt), 0) == (96, False)
        sched.update_state_after_alloc(Request("B", prompt), KVCacheBlocks((table,)), 96)
        meta = sched.build_connector_meta(new_req("B", prompt, table, 96, len(prompt) - 96))
        keys = sched.client.keys(prompt)
        assert sched.client.delete(keys[4:6]) == 2  # gone between the scheduler's Lookup and the load
        eng.step(meta, [(table, reference_kv(model, prompt), 96, len(prompt))])
        assert eng.worker.get_block_ids_with_load_errors() == set(table[4:6])  # vLLM recomputes these
        for n in eng.names:
            assert not (eng.caches[n][:, table[:4]] == SENTINEL).any()
            assert (eng.caches[n][:, table[4:6]] == SENTINEL).all()  # nothing from a failed read


def test_unknown_extra_config_key_is_named(daemon, models):
    with pytest.raises(ValueError, match="kvstore_sock"):
        KVStoreConnector(vllm_config(models["fp32"], daemon.socket_path, kvstore_sock="x"), KVConnectorRole.SCHEDULER)

