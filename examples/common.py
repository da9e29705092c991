"""Shared pieces of the examples: a seeded random Llama built locally (no hub download) and a
private kvstore daemon started as a child process."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from kvstore.local import LocalDaemon
from kvstore.local import start_daemon as _start

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Llama-architecture shapes small enough for a 2-core CPU. initializer_range 0.2 (HF's default
# is 0.02) gives peaked, prompt-dependent greedy outputs instead of one repeated token, so a
# wrong KV byte shows up as different tokens.
MODEL_SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=2048, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                  num_attention_heads=6, num_key_value_heads=2),
}


def build_llama(size: str = "tiny", dtype: str = "fp32", seed: int = 0, max_positions: int = 8192):
    """A ``LlamaForCausalLM`` with seeded random weights from a ``LlamaConfig`` (eval mode).
    The same (size, dtype, seed) gives the same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**MODEL_SIZES[size], max_position_embeddings=max_positions, initializer_range=0.2,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    return model.to(DTYPES[dtype])


def model_id(size: str, seed: int) -> str:
    """Namespace model id: weights are a function of (size, seed); the dtype is in the layout."""
    return f"kvstore-example/llama-{size}-seed{seed}"


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def plain_generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation with HF's own cache: the reference every kvstore path must match."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(workdir: Path, *flags: str, name: str = "kvstore", dram: str = "256MiB",
                 timeout_s: float = 60.0) -> LocalDaemon:
    """Run ``python -m kvstore serve`` on a private socket under ``workdir`` (metrics off) with
    a ``dram`` DRAM tier and wait until it answers its health check."""
    return _start(workdir, name, "--dram-capacity-bytes", dram, "--dram-extent-bytes", "4MiB", *flags,
                  timeout_s=timeout_s)
