"""Triton kernels behind :mod:`kvstore.tiers.kv_copy`: one launch per layer (or per step) moves a
request's KV between paged views and slot-ordered memory, and one launch per transfer moves many
spans inside one device pool.

Every address is a word offset from one base pointer (``base``, a one-word tensor at an address
the caller picked: the registered arena, a staging buffer or the HBM pool), so one launch reaches
the engine's cache tensors and kvstore's memory alike; a word is 1, 2, 4 or 8 bytes, whatever
every address and size of the copy is a multiple of (unaligned slots get narrower words, never a
wrong copy). KV is moved as bytes: the element type never matters.

Imported only where Triton is installed. :func:`build` JIT-compiles the kernels for CUDA (Triton
ships with CUDA builds of torch; no compiler on the user's machine beyond that), or wraps them in
Triton's interpreter for CPU tensors (CI: ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


def paged_rows(base, rows, tok, desc, T, HALVES, HW, DW, HALFW, LAYERW, l0, s0,
               TO_SLOTS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Program (token tile, i) copies ``BT`` tokens x every word of their rows, from page
    layer ``l0 + i`` to (or from) slot layer ``s0 + i``.

    ``rows`` [T, 2] int64: (kernel block, position in it) of each token. ``tok`` [T] int64: word
    offset of the token's row in layer 0 of its slot (any sign: the base is wherever).
    ``desc`` [layers, halves, 6] int64 in words: page offset, block / head / token strides,
    element stride and words per element (a head's words are ``(e // EW) * sD + e % EW``: a
    transposed K page has its elements ``sD`` apart). A row is ``HW = heads * DW`` words per
    half; column ``c`` of the tile is half ``c // HW``, head ``c % HW // DW``, word ``c % DW``.
    Slot side: ``tok + sl * LAYERW + half * HALFW + c % HW`` (kvstore's canonical ``[halves,
    tokens, heads, dim]`` per layer)."""
    pt = tl.program_id(0)
    l = l0 + tl.program_id(1)
    sl = s0 + tl.program_id(1)
    t = pt * BT + tl.arange(0, BT)
    tm = t < T
    kb = tl.load(rows + 2 * t, mask=tm, other=0)
    pos = tl.load(rows + 2 * t + 1, mask=tm, other=0)
    dst = tl.load(tok + t, mask=tm, other=0)
    c = tl.arange(0, BD).to(tl.int64)
    half = c // HW
    inrow = c - half * HW
    head = inrow // DW
    e = inrow - head * DW
    cm = c < HW * HALVES
    d = desc + (l * HALVES + tl.where(cm, half, 0)) * 6
    page = tl.load(d, mask=cm, other=0)
    s_b = tl.load(d + 1, mask=cm, other=0)
    s_h = tl.load(d + 2, mask=cm, other=0)
    s_n = tl.load(d + 3, mask=cm, other=0)
    s_d = tl.load(d + 4, mask=cm, other=0)
    ew = tl.load(d + 5, mask=cm, other=1)
    col = page + head * s_h + (e // ew) * s_d + e % ew
    cache = kb[:, None] * s_b[None, :] + pos[:, None] * s_n[None, :] + col[None, :]
    slot = (dst + sl * LAYERW)[:, None] + (half * HALFW + inrow)[None, :]
    m = tm[:, None] & cm[None, :]
    if TO_SLOTS:
        tl.store(base + slot, tl.load(base + cache, mask=m), mask=m)
    else:
        tl.store(base + cache, tl.load(base + slot, mask=m), mask=m)


def spans(base, table, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program (span, chunk) copies words ``[chunk * CHUNK, +CHUNK)`` of span ``p``: ``table``
    [n, 3] int64 rows of (destination, source, length) in words from ``base``."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    dst = tl.load(table + 3 * p)
    src = tl.load(table + 3 * p + 1)
    n = tl.load(table + 3 * p + 2)
    start = c.to(tl.int64) * CHUNK
    for i in range(0, CHUNK, BLOCK):
        o = start + i + tl.arange(0, BLOCK)
        m = o < n
        tl.store(base + dst + o, tl.load(base + src + o, mask=m), mask=m)


@functools.cache
def build(interpret: bool):
    """``(paged_rows, spans)`` as launchable kernels: compiled for CUDA, or interpreted on the
    CPU. Built on first use, not at import, so the choice is per call site, not per process."""
    # Token count and layer indices change with every request and layer: specializing on them
    # (Triton does for values of 1 and multiples of 16) would compile again mid-serving.
    varying = ["T", "l0", "s0"]
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(paged_rows, do_not_specialize=varying), InterpretedFunction(spans)
    return triton.jit(paged_rows, do_not_specialize=varying), triton.jit(spans)
