"""Lossy codecs (kvstore.lossy): int8 and fp8 with a scale per 64 elements, only for namespaces
that opt in (``kv_codec``), stored quantized on NVMe. Checked on their own, in the NVMe tier
and through real daemons (restart, namespace isolation, a transfer of blocks read back).

The element figures asserted here are loose bounds on normally distributed values; the figures
to quote are on a trained model's KV (``kvstore bench codec``, docs/compression.md)."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import lossy
from kvstore.codec import Codec, CodecError, codec_of, decode
from kvstore.keys import Namespace
from kvstore.layout import KVLayout, LayoutError


def bf16_bits(n: int, seed: int = 0, scale: float = 0.7) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * scale
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def as_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("kind,bound", [("int8", 0.01), ("fp8", 0.04)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_quantize_round_trips_within_the_codec_error(kind, bound, dtype):
    x = np.random.default_rng(1).standard_normal(4096 + 17).astype(np.float32)  # a partial last group
    src = {"bf16": lambda: (x.view(np.uint32) >> 16).astype(np.uint16), "fp16": lambda: x.astype(np.float16),
           "fp32": lambda: x}[dtype]()
    raw = src.view(np.uint8)
    payload = lossy.quantize(raw, dtype, kind)
    assert codec_of(payload) is (Codec.INT8 if kind == "int8" else Codec.FP8)
    back = np.empty_like(raw)
    decode(payload, back)  # the codec module's decoder takes lossy payloads too
    st = lossy.error_stats(raw, dtype, kind)
    assert st["rel_rms_error"] < bound and st["ratio"] > (1.85 if dtype != "fp32" else 3.7)
    assert not np.array_equal(back, raw)  # lossy: it does change the values
    y = {"bf16": lambda: as_f32(back.view(np.uint16)), "fp16": lambda: back.view(np.float16).astype(np.float32),
         "fp32": lambda: back.view(np.float32)}[dtype]()
    ref = {"bf16": lambda: as_f32(src), "fp16": lambda: src.astype(np.float32), "fp32": lambda: src}[dtype]()
    assert np.abs(y - ref).max() <= 0.07 * np.abs(ref).max()


def test_fp8_codes_match_e4m3_and_groups_scale_apart():
    torch = pytest.importorskip("torch")
    y = np.concatenate([np.linspace(-448, 448, 20001, dtype=np.float32),
                        np.array([0, 2 ** -9, 2 ** -10, 3 * 2 ** -10, 447, 2 ** -6, 1e-40], np.float32)])
    ours = lossy._E4M3_SIGNED[lossy._e4m3_codes(y)]
    assert np.array_equal(ours, torch.from_numpy(y).to(torch.float8_e4m3fn).float().numpy())
    # A group of tiny values next to a group of large ones keeps its own precision.
    x = np.concatenate([np.full(64, 1e-3, np.float32), np.full(64, 100.0, np.float32)])
    back = np.empty(x.nbytes, np.uint8)
    lossy.dequantize(lossy.quantize(x.view(np.uint8), "fp32", "int8"), back)
    assert np.allclose(back.view(np.float32), x, rtol=1e-2)


def test_bad_payloads_and_inputs_are_refused():
    raw = bf16_bits(256).view(np.uint8)
    p = bytearray(lossy.quantize(raw, "bf16", "fp8"))
    out = np.empty_like(raw)
    for bad in (p[:-1], p[:10], b"KVQ1" + bytes(20)):
        with pytest.raises(CodecError):
            decode(bytes(bad), out)
    p[-1] = 0x7F  # an fp8 NaN code: never written by quantize
    with pytest.raises(CodecError, match="NaN"):
        decode(bytes(p), out)
    with pytest.raises(CodecError):
        decode(lossy.quantize(raw, "bf16", "int8"), np.empty(raw.nbytes * 2, np.uint8))  # another block size
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        lossy.quantize(raw, "int8", "int8")
    with pytest.raises(ValueError, match="kv_codec"):
        lossy.quantize(raw, "bf16", "int4")


def test_a_lossy_namespace_is_another_namespace_and_refuses_what_it_cannot_quantize():
    lay = KVLayout(2, 2, 64, "bf16")
    exact, q8 = Namespace("m", lay), Namespace("m", lay, kv_codec="int8")
    assert exact.root != q8.root and Namespace("m", lay, kv_codec="fp8").root not in (exact.root, q8.root)
    assert "kv_codec" not in exact.to_dict()  # exact namespaces keep the ids they always had
    assert Namespace.from_dict(q8.to_dict()) == q8 and Namespace.from_dict(exact.to_dict()) == exact
    with pytest.raises(LayoutError, match="kv_codec"):
        Namespace("m", KVLayout(2, 2, 64, "fp8"), kv_codec="int8")
    with pytest.raises(LayoutError, match="kv_codec"):
        Namespace("m", lay, kv_codec="int4")
    with pytest.raises(LayoutError, match="kv_codec"):
        Namespace.from_dict({**exact.to_dict(), "kv_codec": ""})


def test_the_nvme_tier_stores_a_lossy_block_quantized_and_checks_what_it_reads_back(tmp_path):
    from kvstore.tiers.nvme import IoResult, NvmeTier
    from nvme_util import CHUNK, NS, cfg, key

    block = 256 << 10
    raw = [bf16_bits(block // 2, seed=i).view(np.uint8) for i in range(4)]
    c = cfg(tmp_path / "nvme", capacity_bytes=8 << 20, file_bytes=4 << 20, extent_bytes=1 << 20, bounce_bytes=1 << 20)
    with NvmeTier(c) as t:  # the codec setting is off: the namespace's opt-in is enough
        b = t.put_many([(NS, key(i), None, CHUNK, raw[i], None, "bf16", "int8") for i in range(4)])
        assert b.wait(30) and b.error is None
        assert b.digests() == {}  # a quantized block's checksums do not describe its source
        (use,) = t.stats().extra["namespaces"].values()
        assert use["ratio"] > 1.7  # 1.88 in payload, size classes of 8 KiB
        recs = {e.key: e for e in t.entries()}
        assert {e.codec for e in recs.values()} == {int(Codec.INT8)}
        outs = [np.zeros(block, np.uint8) for _ in range(4)]
        g = t.get_many([key(i) for i in range(4)], outs)
        assert g.wait(30) and g.error is None
        for i in range(4):
            expect = np.empty(block, np.uint8)
            lossy.dequantize(lossy.quantize(raw[i], "bf16", "int8"), expect)
            assert np.array_equal(outs[i], expect)  # what it reads back as, every time
        sums = g.digests()
        from kvstore.tiers.nvme.files import chunk_sums
        assert list(sums[key(0)]) == list(chunk_sums(outs[0], block, CHUNK))
        with pytest.raises(ValueError, match="lossy"):
            t.put_many([(NS, key(9), None, CHUNK, raw[0], None, "int8", "int8")])
        # Bytes changed since their checksums were recorded are not quantized under fresh ones:
        # the first read finds the block corrupt, as for a raw block.
        recorded = chunk_sums(raw[0], block, CHUNK)
        changed = raw[0].copy()
        changed[1000] ^= 0x40
        b = t.put_many([(NS, key(8), None, CHUNK, changed, recorded, "bf16", "int8")])
        assert b.wait(30) and b.results[key(8)] is IoResult.OK
        g = t.get_many([key(8)], [np.zeros(block, np.uint8)])
        assert g.wait(30) and g.results[key(8)] is IoResult.CORRUPT
        b = t.put_many([(NS, key(7), None, CHUNK, raw[1], chunk_sums(raw[1], block, CHUNK), "bf16", "int8")])
        assert b.wait(30) and b.results[key(7)] is IoResult.OK
        g = t.get_many([key(7)], [np.zeros(block, np.uint8)])
        assert g.wait(30) and g.results[key(7)] is IoResult.OK  # unchanged: served
    from test_nvme import flip_byte
    flip_byte(c, recs[key(2)].slot + 12 + 3)  # the first scale's exponent byte
    with NvmeTier(c) as t:
        outs = [np.zeros(block, np.uint8) for _ in range(4)]
        g = t.get_many([key(i) for i in range(4)], outs)
        assert g.wait(30) and g.results[key(2)] is IoResult.CORRUPT
        assert [g.results[key(i)] for i in (0, 1, 3)] == [IoResult.OK] * 3


def test_daemon_serves_lossy_blocks_from_nvme_keeps_exact_ones_apart_and_ships_them(tmp_path):
    from daemon_util import DaemonSpec, start_daemons, stop_all
    from kvstore.clients import KVStoreClient

    lay = KVLayout(8, 4, 128, "bf16", "mha")  # 256 KiB blocks; DRAM of 8 MiB: 32 of them
    args = ("--nvme-dir", str(tmp_path / "nvme"), "--nvme-capacity-bytes", "64MiB", "--nvme-file-bytes", "32MiB",
            "--nvme-durable-commit", "true")
    prompts = [list(range(s * 1000, s * 1000 + 8 * 16)) for s in range(6)]  # 48 blocks
    kvs = [bf16_bits(int(np.prod(lay.tensor_shape(128))), seed=s).reshape(lay.tensor_shape(128)) for s in range(6)]

    def close_to(out, kv) -> bool:
        err = np.abs(as_f32(out) - as_f32(kv)).max() / np.abs(as_f32(kv)).max()
        return 0 < err < 0.01

    def ship_and_check(ca, cb, toks, out) -> None:
        """A transfer checks the block's digests on arrival: they must be those of what A's
        DRAM holds now, the dequantized values (not the digests taken when it was written)."""
        assert ca.transfer(ca.keys(toks), b.transfer_addr, deadline_s=20).blocks == 8
        got = np.zeros_like(out)
        assert cb.get(toks, got) == len(toks) and got.tobytes() == out.tobytes()
        cb.delete(cb.keys(toks))

    def pair(suffix: str):
        """Daemon A (NVMe, durable commits) and B, each with a client in the int8 namespace."""
        a, b = start_daemons(tmp_path, DaemonSpec(args, name="a" + suffix, dram="8MiB", transfer="tcp"),
                             DaemonSpec((), name="b" + suffix, transfer="tcp"))
        clients = [KVStoreClient(d.socket_path) for d in (a, b)]
        for c in clients:
            c.register(lay, "lossy-model", kv_codec="int8")
        return a, b, *clients

    a, b, ca, cb = pair("")
    try:
        for toks, kv in zip(prompts, kvs):
            assert ca.put(toks, kv) == 8  # durable: on NVMe (quantized) when put returns
        out = np.zeros_like(kvs[5])
        assert ca.get(prompts[5], out) == 128 and out.tobytes() == kvs[5].tobytes()  # from DRAM: as written
        out = np.zeros_like(kvs[0])
        assert ca.get(prompts[0], out) == 128 and close_to(out, kvs[0])  # evicted from DRAM: read back from NVMe
        ship_and_check(ca, cb, prompts[0], out)
        ca.register(lay, "lossy-model")  # the exact namespace of the same model: nothing of it
        assert ca.lookup(prompts[0]) == 0
        ca.close()
        cb.close()
    finally:
        stop_all(a, b)
    a, b, ca, cb = pair("2")
    try:
        out = np.zeros_like(kvs[5])
        assert ca.get(prompts[5], out) == 128 and close_to(out, kvs[5])  # after a restart: from NVMe
        ship_and_check(ca, cb, prompts[5], out)
        ca.close()
        cb.close()
    finally:
        stop_all(a, b)


def test_the_engine_bench_compares_tokens_up_to_the_first_difference():
    from kvstore.app.bench.vllm_lossy import compare

    def out(tokens, top1, cached=64):
        return {"tokens": tokens, "cached_tokens": cached,
                "logprobs": [[[t, lp], [t + 1, lp - 1.0]] for t, lp in zip(tokens, top1)]}
    ref = [out([1, 2, 3], [-0.1, -0.2, -0.3]), out([4, 5, 6], [-0.1, -0.1, -0.1])]
    got = [out([1, 2, 3], [-0.1, -0.25, -0.3]), out([4, 9, 6], [-0.1, -0.5, -2.0], cached=32)]
    r = compare(ref, got)
    assert (r["prompts_identical"], r["prompts"], r["cached_tokens_min"]) == (1, 2, 32)
    assert r["mean_tokens_before_first_difference"] == 2.0  # 3 and 1
    # steps compared: all 3 of the first prompt, and the second's up to its first difference (2)
    assert abs(r["top1_logprob_delta_max"] - 0.4) < 1e-9
    assert abs(r["top5_overlap_mean"] - 0.8) < 1e-9  # 4 steps with the same top tokens, 1 with none
