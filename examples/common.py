"""Shared pieces of the examples: a seeded random Llama built locally (no hub download) and a
private kvstore daemon started as a child process."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from kvstore.app.bench.vllm_engine import llama_config
from kvstore.app.local import LocalDaemon
from kvstore.app.local import start_daemon as _start

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_llama(size: str = "tiny", dtype: str = "fp32", seed: int = 0, max_positions: int = 8192):
    """A ``LlamaForCausalLM`` with seeded random weights (eval mode). The same (size, dtype,
    seed) gives the same weights in every process, and the same as the model
    :func:`kvstore.app.bench.vllm_engine.save_llama` writes for vLLM (one config for both), so a
    test can hand a prefix from one engine to the other."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(size, max_positions)).eval()
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
