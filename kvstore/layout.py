"""KV layout descriptors: the shape of one model's attention KV and its exact sizes in bytes.

A block holds the KV of ``block_tokens`` consecutive tokens for all layers, stored layer-major:
layer ``l`` of a block is one contiguous chunk of ``layer_chunk_bytes``. Inside a chunk the
order is ``[2 (k, v), block_tokens, kv_heads, head_dim]`` for MHA/GQA/MQA and
``[block_tokens, kv_lora_rank + qk_rope_head_dim]`` for MLA (one latent, no separate V).
A ``state`` layout holds no token rows: each layer's chunk is one recurrent-state snapshot of
``state_bytes`` (a Mamba / linear-attention layer's state after the block's last token, in the
engine's own bytes; the vLLM connector's state groups, :mod:`kvstore.clients.vllm_state`).

That order is the one canonical block format, whoever writes the block: ``put``, the HF adapter
and the vLLM connector on any attention backend convert at the edge, in the copy they make
anyway, so engines of different kinds share prefixes. :data:`BLOCK_FORMAT` names it inside
every namespace hash, so blocks of another format can never be read as these.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass


BLOCK_FORMAT = "layer-major/kv/token-rows/v1"


class LayoutError(ValueError):
    """A layout field is missing or out of range; the message names the field."""


class DType(enum.Enum):
    """KV element types and their width in bits (int4 packs two elements per byte)."""

    FP32 = ("fp32", 32)
    FP16 = ("fp16", 16)
    BF16 = ("bf16", 16)
    FP8_E4M3 = ("fp8_e4m3", 8)
    FP8_E5M2 = ("fp8_e5m2", 8)
    INT8 = ("int8", 8)
    INT4 = ("int4", 4)

    def __init__(self, label: str, bits: int) -> None:
        self.label = label
        self.bits = bits

    @classmethod
    def parse(cls, text: str) -> "DType":
        aliases = {"fp8": "fp8_e4m3", "float8": "fp8_e4m3", "float16": "fp16", "half": "fp16",
                   "bfloat16": "bf16", "float32": "fp32", "float": "fp32"}
        name = aliases.get(str(text).lower(), str(text).lower())
        for member in cls:
            if member.label == name:
                return member
        known = ", ".join(m.label for m in cls)
        raise LayoutError(f"dtype: unknown KV dtype {text!r}; known: {known} (and fp8)")


class AttnKind(enum.Enum):
    """Attention variant; decides how many KV tensors a layer stores."""

    MHA = "mha"
    GQA = "gqa"
    MQA = "mqa"
    MLA = "mla"
    STATE = "state"  # a recurrent-state snapshot per layer and block, not token rows

    @classmethod
    def parse(cls, text: str) -> "AttnKind":
        try:
            return cls(str(text).lower())
        except ValueError:
            raise LayoutError(f"kind: unknown attention kind {text!r}; known: mha, gqa, mqa, mla, state") from None


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{name}: must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One model's KV shape. Sizes are bytes; ``block_tokens`` is tokens per block."""

    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: DType = DType.BF16
    kind: AttnKind = AttnKind.GQA
    block_tokens: int = 16
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    state_bytes: int = 0  # state only: bytes of one layer's snapshot

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", DType.parse(self.dtype))
        if isinstance(self.kind, str):
            object.__setattr__(self, "kind", AttnKind.parse(self.kind))
        _positive("num_layers", self.num_layers)
        _positive("block_tokens", self.block_tokens)
        if self.kind is AttnKind.STATE:
            _positive("state_bytes", self.state_bytes)
            if self.dtype is not DType.INT8:
                raise LayoutError(f"dtype: a state layout holds the engine's bytes (int8), got {self.dtype.label}")
            return
        if self.state_bytes:
            raise LayoutError(f"state_bytes: only a state layout has one, not {self.kind.value}")
        if self.kind is AttnKind.MLA:
            _positive("kv_lora_rank", self.kv_lora_rank)
            if self.qk_rope_head_dim < 0:
                raise LayoutError(f"qk_rope_head_dim: must be >= 0, got {self.qk_rope_head_dim}")
        else:
            _positive("num_kv_heads", self.num_kv_heads)
            _positive("head_dim", self.head_dim)
            if self.kind is AttnKind.MQA and self.num_kv_heads != 1:
                raise LayoutError(f"num_kv_heads: MQA has exactly 1 KV head, got {self.num_kv_heads}")
        if (self.elements_per_token_layer * self.dtype.bits) % 8:
            raise LayoutError("dtype: int4 needs an even number of elements per token and layer")

    @property
    def elements_per_token_layer(self) -> int:
        """KV elements one token stores in one layer (K and V, or the MLA latent + rope; a state
        layout's snapshot spread over the block's tokens, rounded up)."""
        if self.kind is AttnKind.STATE:
            return -(-self.state_bytes // self.block_tokens)
        if self.kind is AttnKind.MLA:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token_layer(self) -> int:
        return self.elements_per_token_layer * self.dtype.bits // 8

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_layer * self.num_layers

    @property
    def layer_chunk_bytes(self) -> int:
        """Bytes of one layer of one block: the unit of layer-pipelined transfer."""
        if self.kind is AttnKind.STATE:
            return self.state_bytes
        return self.bytes_per_token_layer * self.block_tokens

    @property
    def block_bytes(self) -> int:
        return self.layer_chunk_bytes * self.num_layers

    def tensor_shape(self, tokens: int) -> tuple[int, ...]:
        """Layer-major shape clients hand over: ``[layers, 2, tokens, kv_heads, head_dim]``
        or, for MLA, ``[layers, tokens, kv_lora_rank + qk_rope_head_dim]``. int4 is packed:
        the last dimension is halved and the element type is uint8."""
        if self.kind is AttnKind.MLA:
            last = self.kv_lora_rank + self.qk_rope_head_dim
            return (self.num_layers, tokens, last // 2 if self.dtype is DType.INT4 else last)
        last = self.head_dim // 2 if self.dtype is DType.INT4 else self.head_dim
        if self.dtype is DType.INT4 and self.head_dim % 2:
            # Odd head_dim with int4 cannot be expressed per head; pack over heads instead.
            return (self.num_layers, 2, tokens, self.num_kv_heads * self.head_dim // 2)
        return (self.num_layers, 2, tokens, self.num_kv_heads, last)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = self.dtype.label
        d["kind"] = self.kind.value
        if not self.state_bytes:
            del d["state_bytes"]  # so the namespaces of token-row layouts hash as they always did
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"{sorted(unknown)[0]}: unknown layout field")
        if "num_layers" not in d:
            raise LayoutError("num_layers: missing")
        return cls(**d)


@dataclass(frozen=True, slots=True)
class HeadShard:
    """The KV heads one tensor-parallel rank holds, in a block that holds all of them.

    A block of a TP-agnostic namespace (TP=1's: ``tp_rank`` 0 of 1) has every KV head of its
    tokens, in the canonical layout. Rank ``r`` of ``k`` holds heads ``[first, first + count)``
    and writes them as part ``part`` of ``parts`` into the same block (columns of each token
    row); the daemon publishes the block once every part is committed, so engines of any TP
    size read each other's blocks. With fewer KV heads than ranks (each head replicated on
    ``k / heads`` ranks) the first rank of each head writes it, the others only read."""

    first: int
    count: int
    part: int
    parts: int
    writes: bool = True

    @classmethod
    def of_rank(cls, num_kv_heads: int, tp_rank: int, tp_world: int) -> "HeadShard":
        """Rank ``tp_rank``'s heads of ``num_kv_heads``, split as vLLM and SGLang split them."""
        if not 0 <= tp_rank < tp_world:
            raise LayoutError(f"tp_rank: must be in [0, {tp_world}), got {tp_rank}")
        if num_kv_heads >= tp_world:
            if num_kv_heads % tp_world:
                raise LayoutError(f"num_kv_heads: {num_kv_heads} KV heads do not split over {tp_world} ranks")
            per = num_kv_heads // tp_world
            return cls(tp_rank * per, per, tp_rank, tp_world)
        if tp_world % num_kv_heads:
            raise LayoutError(f"num_kv_heads: {num_kv_heads} KV heads cannot be replicated over {tp_world} ranks")
        reps = tp_world // num_kv_heads
        head = tp_rank // reps
        return cls(head, 1, head, num_kv_heads, writes=tp_rank % reps == 0)

    def columns(self, layout: KVLayout) -> tuple[int, int]:
        """Byte range ``[start, end)`` of this shard's heads in one token row of one half (K or
        V) of ``layout``'s blocks (``num_kv_heads * head_dim`` elements)."""
        if layout.kind in (AttnKind.MLA, AttnKind.STATE):
            raise LayoutError(f"kind: a {layout.kind.value} block has no KV heads to split")
        if self.first + self.count > layout.num_kv_heads:
            raise LayoutError(f"heads [{self.first}, {self.first + self.count}) of {layout.num_kv_heads}")
        head_bits = layout.head_dim * layout.dtype.bits
        if head_bits % 8:
            raise LayoutError(f"dtype: one {layout.dtype.label} head of {layout.head_dim} elements is not whole bytes")
        return self.first * head_bits // 8, (self.first + self.count) * head_bits // 8

    def local(self, layout: KVLayout) -> KVLayout:
        """The layout of the heads this rank holds (its own KV cache's pages)."""
        kind = layout.kind if self.count == layout.num_kv_heads else (AttnKind.MQA if self.count == 1 else AttnKind.GQA)
        return KVLayout(num_layers=layout.num_layers, num_kv_heads=self.count, head_dim=layout.head_dim,
                        dtype=layout.dtype, kind=kind, block_tokens=layout.block_tokens)
