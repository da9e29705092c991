"""The lossless block codecs (kvstore.codec): bit-exact round trips of every KV dtype through
both codecs (the C codec's payloads also through its numpy decoder), raw where encoding would not
pay, clear errors for corrupt payloads. Ratios are measured on a trained model's KV
(tests/trained_kv.py: all-MiniLM-L6-v2), not random weights."""

import numpy as np
import pytest

from kvstore import codec as kvcodec
from kvstore.codec import Codec, CodecError, MIN_SAVING, decode, encode

torch = pytest.importorskip("torch")

from trained_kv import trained_kv  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn"}
# Least ratio each codec reaches on the trained KV (issue 33: bf16 >= 1.3, fp8 >= 1.08).
LEAST = {("bf16", Codec.PLANES_ZSTD): 1.3, ("fp16", Codec.PLANES_ZSTD): 1.1, ("fp32", Codec.PLANES_ZSTD): 1.1,
         ("fp8_e4m3", Codec.PLANES_ZSTD): 1.08, ("bf16", Codec.NIBBLE): 1.3, ("fp16", Codec.NIBBLE): 1.08,
         ("fp32", Codec.NIBBLE): 1.1, ("fp8_e4m3", Codec.NIBBLE): 1.08}
needs_c = pytest.mark.skipif(kvcodec.native() is None, reason="the C codec is not built (make codec)")


def block(kv, dtype: str) -> np.ndarray:
    return kv.to(getattr(torch, DTYPES[dtype])).contiguous().view(torch.uint8).numpy().reshape(-1)


@pytest.fixture(scope="module")
def kv():
    return trained_kv(tokens=256)


@pytest.mark.parametrize("dtype,which", sorted(LEAST, key=str), ids=lambda x: getattr(x, "name", x))
def test_trained_kv_round_trips_bit_exact_and_shrinks(kv, dtype, which):
    if which is Codec.NIBBLE and kvcodec.native() is None:
        pytest.skip("the C codec is not built (make codec)")
    raw = block(kv, dtype)
    payload = encode(raw, dtype, which)
    assert payload is not None
    ratio = raw.nbytes / len(payload)
    print(f"{dtype} {which.name}: {raw.nbytes} -> {len(payload)} bytes, ratio {ratio:.3f}")
    assert ratio >= LEAST[dtype, which]
    out = np.empty_like(raw)
    decode(payload, out)
    assert np.array_equal(out, raw)
    if which is Codec.NIBBLE:  # a daemon built without the C codec reads the same bytes back
        again = np.empty_like(raw)
        kvcodec._decode_nibble_numpy(np.frombuffer(payload, np.uint8), again)
        assert np.array_equal(again, raw)


@needs_c
@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 17, 4099])
def test_nibble_odd_sizes_escapes_and_tails(n):
    """Element counts that end mid code byte or mid group of 8, and every prefix escaping."""
    rng = np.random.default_rng(n)
    for dtype, ts in (("bf16", 2), ("fp8_e4m3", 1), ("fp16", 2), ("fp32", 4)):
        few = rng.integers(0, 256, n * ts, dtype=np.uint8)
        lib = kvcodec.native()
        out = np.empty(few.nbytes * 2 + 64, np.uint8)
        m = lib.kvn_encode(few.ctypes.data, n, ts, kvcodec.PREFIX_BITS[kvcodec.DType.parse(dtype)], out.ctypes.data,
                           out.nbytes, out.nbytes)  # any size allowed: many escapes
        assert m
        for dec in (decode, lambda p, d: kvcodec._decode_nibble_numpy(np.frombuffer(p, np.uint8), d)):
            back = np.empty_like(few)
            dec(out[:m].tobytes(), back)
            assert np.array_equal(back, few), (dtype, n)


@pytest.mark.parametrize("which", [Codec.PLANES_ZSTD, pytest.param(Codec.NIBBLE, marks=needs_c)])
def test_what_does_not_compress_is_left_raw(which):
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    assert encode(noise, "bf16", which) is None
    zeros = np.zeros(1 << 16, np.uint8)
    payload = encode(zeros, "bf16", which)
    assert payload is not None and len(payload) < (1 << 16) * (1 - MIN_SAVING)
    out = np.ones_like(zeros)
    decode(payload, out)
    assert not out.any()


def test_corrupt_or_truncated_planes_payloads_are_refused(kv):
    raw = block(kv, "bf16")
    payload = bytearray(encode(raw, "bf16", Codec.PLANES_ZSTD))
    out = np.empty_like(raw)
    for bad, why in [(b"XXXX" + payload[4:], "bad magic"), (payload[:-10], "announced"),
                     (payload + b"\0", "trailing"), (payload[:5], "truncated plane table")]:
        with pytest.raises(CodecError, match=why):
            decode(bytes(bad), out)
    flipped = bytearray(payload)
    flipped[len(flipped) // 3] ^= 0xFF  # inside the compressed exponent plane
    try:
        decode(bytes(flipped), out)
    except CodecError:
        pass  # zstd's frame check caught it
    else:
        assert not np.array_equal(out, raw)  # or it decodes to other bytes: the block checksum catches it
    with pytest.raises(CodecError, match="does not fit"):
        decode(bytes(payload), np.empty(raw.nbytes + 1, np.uint8))


@needs_c
def test_a_payload_that_fits_the_limit_exactly_is_encoded():
    """One escape left in the room and one element of a pair escaping: it fits."""
    lib, src = kvcodec.native(), np.frombuffer(bytes([0, 1, 0, 2]), np.uint8)
    big = np.empty(256, np.uint8)
    size = lib.kvn_encode(src.ctypes.data, 2, 2, 8, big.ctypes.data, big.nbytes, big.nbytes)
    exact = np.empty(size, np.uint8)
    assert size and lib.kvn_encode(src.ctypes.data, 2, 2, 8, exact.ctypes.data, size, size) == size


@needs_c
def test_corrupt_or_truncated_nibble_payloads_are_refused_by_both_decoders(kv):
    raw = block(kv, "fp8_e4m3")
    payload = bytearray(encode(raw, "fp8_e4m3", Codec.NIBBLE))
    out = np.empty_like(raw)
    escapes = int.from_bytes(payload[12:16], "little")
    more = bytearray(payload)
    more[12:16] = (escapes + 1).to_bytes(4, "little")
    wide = bytearray(payload)
    wide[32 + 14] = 0xFF  # an unused dictionary entry wider than fp8's 5 prefix bits
    cases = [(payload[:-1], "length does not match"), (bytes(8) + payload[8:], "bad magic"),
             (more + b"\0", "escape count does not match"), (wide, "prefix wider")]
    for dec in (decode, lambda p, d: kvcodec._decode_nibble_numpy(np.frombuffer(p, np.uint8), d)):
        for bad, why in cases:
            with pytest.raises(CodecError, match=why):
                dec(bytes(bad), out)
        with pytest.raises(CodecError, match="does not fit"):
            dec(bytes(payload), np.empty(raw.nbytes + 1, np.uint8))


def test_codec_names_parse():
    assert Codec.parse("planes-zstd") is Codec.PLANES_ZSTD and Codec.parse("off") is Codec.RAW
    assert Codec.parse("nibble") is Codec.NIBBLE
    with pytest.raises(ValueError, match="expected one of"):
        Codec.parse("gzip")
    with pytest.raises(ValueError, match="typesize"):
        encode(np.zeros(9, np.uint8), "bf16", Codec.PLANES_ZSTD)


def test_bench_codec_runs_on_trained_kv(tmp_path):
    import json
    import subprocess
    import sys

    nvme = ["--nvme", str(tmp_path), "--nvme-bytes", "24MiB", "--extent-bytes", "4MiB", "--rounds", "1"]
    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", "codec", "--tokens", "256", "--reps", "1",
                          "--dtypes", "bf16", "fp8_e4m3", "--json", *(nvme if kvcodec.native() else [])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    if kvcodec.native() is not None:  # the NVMe tier through two daemons, codec off and on
        n = r["nvme"]
        assert n["verified"] and n["rounds"][0]["raw_blocks"] == 6 * 7  # 4 MiB extents of 7 raw 576 KiB blocks
        assert n["capacity_ratio"] >= 1.25 and n["raw_read_GBps"] > 0 and n["codec_read_GBps"] > 0
    assert r["kv"].startswith("all-MiniLM-L6-v2 (trained)") and set(r["rows"]) == {"bf16", "fp8_e4m3"}
    codecs = ["kvstore_planes_zstd"] + (["kvstore_nibble"] if kvcodec.native() is not None else [])
    for dt, least in (("bf16", 1.3), ("fp8_e4m3", 1.08)):
        row = r["rows"][dt]
        assert row["memcpy_gbps"] > 0 and set(row["meets"]) <= set(codecs)
        for name in codecs:  # no speed asserted: a shared CI core says nothing about it
            assert row[name]["ratio"] >= least and row[name]["encode_gbps"] > 0 and row[name]["decode_gbps"] > 0
