"""Model facts read from a Hugging Face ``config.json``: KV layout, parameter counts, prefill FLOPs.

The KV shape comes from ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``
and ``head_dim`` (or ``hidden_size / num_attention_heads``); MLA models (DeepSeek-V2/V3) are
recognised by ``kv_lora_rank`` and store one latent of ``kv_lora_rank + qk_rope_head_dim``
elements per token and layer. Parameter counts follow the Llama / Mistral / Mixtral / Qwen2 /
DeepSeek-V2/V3 module structure; other architectures still size their KV correctly, and
``plan --params`` overrides the count.

Hybrid models name each layer's kind: ``layer_types`` (``full_attention``, ``sliding_attention``,
``linear_attention``: Gemma-3, gpt-oss, Qwen3-Next), or Gemma-3's older ``sliding_window_pattern``
and Qwen3-Next's ``full_attention_interval``. Windowed layers keep KV for ``sliding_window``
tokens only; linear-attention (gated delta net) layers keep a fixed-size state per sequence
instead of KV per token, so the KV layout holds the attention layers only.

Presets are HF-style config files shipped in ``kvstore/presets/<name>.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from kvstore.layout import AttnKind, DType, KVLayout, LayoutError

PRESET_PACKAGE = "kvstore.presets"

# Scale storage that quantized KV needs besides the values (the layout's block bytes hold the
# values only). fp8 uses one fp32 scale per layer for K and one for V (per-tensor, as vLLM
# does), which is not per token. int8 / int4 use one fp16 scale per token, per KV head, for K
# and for V (symmetric per-token-per-head quantization); MLA has one fp16 scale per token for
# its latent.
SCALE_NOTE = ("fp8: per-tensor fp32 scales (2 per layer, not per token); int8/int4: one fp16 "
              "scale per token per KV head for K and for V (MLA: one per token for the latent)")


class ModelConfigError(LayoutError):
    """A model config field is missing or out of range; the message names the field."""


def _int(d: Mapping[str, Any], key: str, source: str, *, required: bool = True, minimum: int = 1,
         default: int = 0) -> int:
    value = d.get(key)
    if value is None:
        if required:
            raise ModelConfigError(f"{key}: missing from {source}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelConfigError(f"{key}: must be {want}, got {value!r} in {source}")
    return value


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The fields of one model that size its KV cache, its weights and its prefill cost."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int = 0           # 0: unknown (parameter count unavailable)
    intermediate_size: int = 0    # 0: unknown (parameter count unavailable)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 0
    weight_dtype: DType = DType.BF16
    kv_lora_rank: int = 0         # > 0: MLA
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    num_experts: int = 0          # routed experts per MoE layer; 0: dense model
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    first_dense_layers: int = 0
    moe_layer_freq: int = 1
    layer_kinds: tuple[str, ...] = ()  # per layer, LAYER_KINDS; (): every layer full attention
    sliding_window: int = 0            # tokens a "sliding" layer attends to
    linear_num_key_heads: int = 0      # linear-attention (gated delta net) layers' state shape
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    # -- layer kinds ---------------------------------------------------------------------------

    def layers_of(self, kind: str) -> int:
        """How many layers are of ``kind`` (``full``, ``sliding`` or ``linear``)."""
        if not self.layer_kinds:
            return self.num_layers if kind == "full" else 0
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def is_hybrid(self) -> bool:
        return any(k != "full" for k in self.layer_kinds)

    @property
    def kv_layers(self) -> int:
        """Layers that keep KV per token (full and sliding-window attention)."""
        return self.num_layers - self.layers_of("linear")

    def state_bytes_per_layer(self, tp: int = 1) -> int:
        """One linear-attention layer's state per sequence on one GPU of a TP group, as vLLM
        keeps it by default: the causal-conv window over q, k and v (``conv_kernel - 1``
        positions) and the delta-net state (value heads x key dim x value dim), both in the
        model's dtype (vLLM 0.32's ``mamba_cache_dtype``/``mamba_ssm_cache_dtype`` ``auto``;
        the tiny Qwen3-Next in bf16 keeps 35,840 B per layer, tests/test_vllm_hybrid.py). Heads
        split over the group."""
        if not self.layers_of("linear"):
            return 0
        kh, vh = self.linear_num_key_heads // tp or 1, self.linear_num_value_heads // tp or 1
        conv_dim = 2 * kh * self.linear_key_head_dim + vh * self.linear_value_head_dim
        conv = max(self.linear_conv_kernel_dim - 1, 0) * conv_dim * self.weight_dtype.bits // 8
        return conv + vh * self.linear_key_head_dim * self.linear_value_head_dim * self.weight_dtype.bits // 8

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kind(self) -> AttnKind:
        if self.is_mla:
            return AttnKind.MLA
        if self.num_kv_heads == 1:
            return AttnKind.MQA
        return AttnKind.MHA if self.num_kv_heads == self.num_heads else AttnKind.GQA

    # -- KV sizes ------------------------------------------------------------------------------

    def layout(self, dtype: DType | str = DType.BF16, block_tokens: int = 16) -> KVLayout:
        """The whole model's KV layout (all KV heads, as one unsharded replica holds it)."""
        return self._layout(dtype, block_tokens, self.num_kv_heads)

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each GPU of a tensor-parallel group holds. Heads are split over the group;
        with more GPUs than heads every GPU holds one head (replicated). MLA: 0 (its one latent
        is replicated on every GPU, see :meth:`gpu_layout`)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ModelConfigError(f"tp: must be a positive integer, got {tp!r}")
        if self.is_mla:
            return 0
        if tp <= self.num_kv_heads:
            if self.num_kv_heads % tp:
                raise ModelConfigError(f"tp: {tp} does not divide num_key_value_heads={self.num_kv_heads}")
            return self.num_kv_heads // tp
        if tp % self.num_kv_heads:
            raise ModelConfigError(f"tp: {tp} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        return 1

    def gpu_layout(self, dtype: DType | str, tp: int, block_tokens: int = 16) -> KVLayout:
        """KV layout of the shard one GPU holds under tensor parallelism ``tp``. MLA's latent is
        shared by all heads, so every GPU keeps the whole latent (as vLLM and SGLang do)."""
        heads = self.kv_heads_per_gpu(tp)
        return self._layout(dtype, block_tokens, heads or self.num_kv_heads)

    def _layout(self, dtype: DType | str, block_tokens: int, kv_heads: int) -> KVLayout:
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        if self.is_mla:
            return KVLayout(num_layers=self.kv_layers, dtype=dt, kind=AttnKind.MLA,
                            block_tokens=block_tokens, kv_lora_rank=self.kv_lora_rank,
                            qk_rope_head_dim=self.qk_rope_head_dim)
        kind = self.kind if kv_heads == self.num_kv_heads else (AttnKind.MQA if kv_heads == 1 else AttnKind.GQA)
        return KVLayout(num_layers=self.kv_layers, num_kv_heads=kv_heads, head_dim=self.head_dim,
                        dtype=dt, kind=kind, block_tokens=block_tokens)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def attn_v_head_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    def mha_bytes_per_token(self, dtype: DType | str = DType.BF16) -> int:
        """Bytes per token the same model would store as full MHA: K and V for every attention
        head in every layer (for MLA, the decompressed per-head K and V). Used for GQA/MLA saving."""
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        elements = self.num_heads * (self.qk_head_dim + self.attn_v_head_dim) * self.kv_layers
        return elements * dt.bits // 8

    def scale_bytes_per_token(self, dtype: DType | str, kv_heads: int | None = None) -> int:
        """Scale bytes per token (all layers) that quantized KV adds; see ``SCALE_NOTE``.
        ``kv_heads`` defaults to all KV heads (pass a per-GPU count for one shard)."""
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        if dt not in (DType.INT8, DType.INT4):
            return 0
        scales = 1 if self.is_mla else 2 * (self.num_kv_heads if kv_heads is None else kv_heads)
        return scales * 2 * self.kv_layers

    # -- parameters and FLOPs ------------------------------------------------------------------

    def _need(self, field: str, value: int) -> None:
        if value <= 0:
            raise ModelConfigError(f"{field}: missing from the config of {self.name}; needed to count "
                              "parameters (or pass --params)")

    def _attn_params(self) -> int:
        h, heads = self.hidden_size, self.num_heads
        if self.is_mla:
            q_out = heads * self.qk_head_dim
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank else h * q_out
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank \
                + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + heads * self.v_head_dim * h
        q, kv = heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        return h * q + 2 * h * kv + q * h + bias

    def _is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense_layers and i % self.moe_layer_freq == 0

    def _layer_params(self, i: int, active: bool) -> int:
        h = self.hidden_size
        if self._is_moe_layer(i):
            self._need("moe_intermediate_size", self.moe_intermediate_size)
            experts = (self.experts_per_token if active else self.num_experts) + self.shared_experts
            mlp = experts * 3 * h * self.moe_intermediate_size + h * self.num_experts  # + router
        else:
            mlp = 3 * h * self.intermediate_size  # gated MLP: gate, up, down
        return self._attn_params() + mlp + 2 * h  # two RMSNorms

    def embedding_params(self) -> int:
        """Input embedding plus LM head (counted once when tied)."""
        self._need("vocab_size", self.vocab_size)
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def params(self, active: bool = False) -> int:
        """Parameter count; ``active=True`` counts only the experts one token runs through."""
        self._need("vocab_size", self.vocab_size)
        self._need("intermediate_size", self.intermediate_size)
        layers = sum(self._layer_params(i, active) for i in range(self.num_layers))
        return self.embedding_params() + layers + self.hidden_size  # + final norm

    def linear_flops_per_token(self) -> int:
        """Prefill FLOPs per token outside attention scores: 2 x active non-embedding params.
        Embedding lookup is not a matmul and prefill runs the LM head for the last token only."""
        return 2 * (self.params(active=True) - self.embedding_params())

    def attn_flops_per_pair(self) -> int:
        """FLOPs per (query, key) pair summed over layers: QK^T and attention-times-V, 2 FLOPs
        per multiply-add, over all query heads. A causal prefill of n tokens has n(n+1)/2 pairs."""
        return 2 * self.num_heads * (self.qk_head_dim + self.attn_v_head_dim) * self.kv_layers


# layer_types values (HF) -> kvstore's layer kinds
LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "linear_attention": "linear"}
LAYER_KINDS = ("full", "sliding", "linear")


def _layer_kinds(d: Mapping[str, Any], layers: int, src: str) -> tuple[str, ...]:
    types = d.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelConfigError(f"layer_types: expected a list of {layers} layer types in {src}, got {types!r}")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ModelConfigError(f"layer_types: {bad[0]!r} in {src} is not a layer type kvstore knows "
                                   f"(known: {', '.join(LAYER_TYPES)})")
        kinds = tuple(LAYER_TYPES[t] for t in types)
    elif d.get("sliding_window_pattern") is not None and d.get("sliding_window") is not None:
        every = _int(d, "sliding_window_pattern", src)  # Gemma-3: every n-th layer is global
        kinds = tuple("full" if (i + 1) % every == 0 else "sliding" for i in range(layers))
    elif d.get("full_attention_interval") is not None:
        every = _int(d, "full_attention_interval", src)  # Qwen3-Next: every n-th layer is attention
        kinds = tuple("full" if (i + 1) % every == 0 else "linear" for i in range(layers))
    else:
        return ()
    if "sliding" in kinds:
        _int(d, "sliding_window", src)
    if all(k == "linear" for k in kinds):
        raise ModelConfigError(f"layer_types: every layer of {src} is linear attention; there is no KV to store")
    return kinds if any(k != "full" for k in kinds) else ()
def _weight_dtype(d: Mapping[str, Any], source: str) -> DType:
    quant = d.get("quantization_config") or {}
    if isinstance(quant, Mapping) and str(quant.get("quant_method", "")).lower() == "fp8":
        return DType.FP8_E4M3
    text = d.get("torch_dtype") or d.get("dtype")
    if text is None:
        return DType.BF16
    try:
        return DType.parse(text)
    except LayoutError:
        raise ModelConfigError(f"torch_dtype: unknown weight dtype {text!r} in {source}") from None


def from_hf(d: Mapping[str, Any], name: str = "config.json") -> ModelConfig:
    """Parse a Hugging Face ``config.json`` dict. Multimodal configs are read from their
    ``text_config``. Raises :class:`ModelConfigError` naming the first bad or missing field."""
    if not isinstance(d, Mapping):
        raise ModelConfigError(f"config: expected a JSON object in {name}, got {type(d).__name__}")
    if "num_hidden_layers" not in d and isinstance(d.get("text_config"), Mapping):
        d = {**d["text_config"], **{k: d[k] for k in ("torch_dtype", "quantization_config") if k in d}}
    src = name
    layers = _int(d, "num_hidden_layers", src)
    hidden = _int(d, "hidden_size", src)
    heads = _int(d, "num_attention_heads", src)
    # HF's Llama config treats a missing num_key_value_heads as full MHA.
    kv_heads = _int(d, "num_key_value_heads", src, required=False, default=heads)
    mla = d.get("kv_lora_rank") is not None
    if mla:
        head_dim = 0
    elif d.get("head_dim") is not None:
        head_dim = _int(d, "head_dim", src)
    elif hidden % heads:
        raise ModelConfigError(f"head_dim: missing from {src} and hidden_size={hidden} is not a "
                          f"multiple of num_attention_heads={heads}")
    else:
        head_dim = hidden // heads
    if not mla and heads % kv_heads:
        raise ModelConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads={heads} in {src}")
    experts = _int(d, "n_routed_experts", src, required=False) or _int(d, "num_local_experts", src, required=False)
    moe_inter = _int(d, "moe_intermediate_size", src, required=False)
    inter = _int(d, "intermediate_size", src, required=False)
    tie = d.get("tie_word_embeddings", False)
    kinds = _layer_kinds(d, layers, src)
    linear = "linear" in kinds
    return ModelConfig(
        name=str(d.get("_name_or_path") or name), num_layers=layers, hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        vocab_size=_int(d, "vocab_size", src, required=False),
        intermediate_size=inter,
        tie_word_embeddings=bool(tie),
        # Qwen2 hard-codes biases on q/k/v; others say so with attention_bias.
        qkv_bias=d.get("model_type") == "qwen2" or bool(d.get("attention_bias", False)),
        max_position_embeddings=_int(d, "max_position_embeddings", src, required=False),
        weight_dtype=_weight_dtype(d, src),
        kv_lora_rank=_int(d, "kv_lora_rank", src, required=mla),
        q_lora_rank=_int(d, "q_lora_rank", src, required=False),
        qk_rope_head_dim=_int(d, "qk_rope_head_dim", src, required=mla, minimum=0),
        qk_nope_head_dim=_int(d, "qk_nope_head_dim", src, required=mla, minimum=0),
        v_head_dim=_int(d, "v_head_dim", src, required=mla),
        num_experts=experts,
        experts_per_token=_int(d, "num_experts_per_tok", src, required=experts > 0),
        # Mixtral's experts are full-size MLPs and its config has no moe_intermediate_size.
        moe_intermediate_size=moe_inter or (inter if experts else 0),
        shared_experts=_int(d, "n_shared_experts", src, required=False, minimum=0),
        first_dense_layers=_int(d, "first_k_dense_replace", src, required=False, minimum=0),
        moe_layer_freq=_int(d, "moe_layer_freq", src, required=False, default=1),
        layer_kinds=kinds,
        sliding_window=_int(d, "sliding_window", src, required=False) if "sliding" in kinds else 0,
        linear_num_key_heads=_int(d, "linear_num_key_heads", src, required=linear),
        linear_num_value_heads=_int(d, "linear_num_value_heads", src, required=linear),
        linear_key_head_dim=_int(d, "linear_key_head_dim", src, required=linear),
        linear_value_head_dim=_int(d, "linear_value_head_dim", src, required=linear),
        linear_conv_kernel_dim=_int(d, "linear_conv_kernel_dim", src, required=False, default=4 if linear else 0),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse a ``config.json`` file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ModelConfigError(f"config: cannot read {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"config: {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    return from_hf(data, str(p))


def preset_names() -> list[str]:
    """Names of the presets shipped in the package, sorted."""
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".json"))


def load_preset(name: str) -> ModelConfig:
    """Parse the preset config ``kvstore/presets/<name>.json`` (name is case-insensitive)."""
    key = str(name).lower()
    names = preset_names()
    if key not in names:
        raise ModelConfigError(f"preset: unknown preset {name!r}; known: {', '.join(names)}")
    text = resources.files(PRESET_PACKAGE).joinpath(f"{key}.json").read_text()
    return from_hf(json.loads(text), f"preset {key}")
