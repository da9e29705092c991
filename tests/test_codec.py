"""The lossless block codec (kvstore.codec): bit-exact round trips of every KV dtype, raw where
encoding would not pay, clear errors for corrupt payloads. Ratios are measured on a trained
model's KV (tests/trained_kv.py: all-MiniLM-L6-v2), not random weights."""

import numpy as np
import pytest

from kvstore.codec import Codec, CodecError, MIN_SAVING, decode, encode

torch = pytest.importorskip("torch")

from trained_kv import trained_kv  # noqa: E402


@pytest.fixture(scope="module")
def kv():
    return trained_kv(tokens=256)


@pytest.mark.parametrize("dtype,least", [("bfloat16", 1.3), ("float16", 1.05), ("float32", 1.1),
                                         ("float8_e4m3fn", 1.08)])
def test_trained_kv_round_trips_bit_exact_and_shrinks(kv, dtype, least):
    x = kv.to(getattr(torch, dtype)).contiguous()
    raw = x.view(torch.uint8).numpy().reshape(-1)
    payload = encode(raw, x.element_size())
    assert payload is not None
    ratio = raw.nbytes / len(payload)
    print(f"{dtype}: {raw.nbytes} -> {len(payload)} bytes, ratio {ratio:.3f}")
    assert ratio >= least
    out = np.empty_like(raw)
    decode(payload, out)
    assert np.array_equal(out, raw)


def test_what_does_not_compress_is_left_raw():
    noise = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    assert encode(noise, 2) is None
    zeros = np.zeros(1 << 16, np.uint8)
    payload = encode(zeros, 2)
    assert payload is not None and len(payload) < (1 << 16) * MIN_SAVING
    out = np.ones_like(zeros)
    decode(payload, out)
    assert not out.any()


def test_corrupt_or_truncated_payloads_are_refused(kv):
    raw = kv.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1)
    payload = bytearray(encode(raw, 2))
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


def test_codec_names_parse():
    assert Codec.parse("planes-zstd") is Codec.PLANES_ZSTD and Codec.parse("off") is Codec.RAW
    with pytest.raises(ValueError, match="expected one of"):
        Codec.parse("gzip")
    with pytest.raises(ValueError, match="typesize"):
        encode(np.zeros(9, np.uint8), 2)


def test_bench_codec_runs_on_trained_kv():
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kvstore", "bench", "codec", "--tokens", "256", "--reps", "1",
                          "--dtypes", "bf16", "fp8_e4m3", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["kv"].startswith("all-MiniLM-L6-v2 (trained)") and set(r["rows"]) == {"bf16", "fp8_e4m3"}
    assert r["rows"]["bf16"]["ratio"] >= 1.3 and r["rows"]["fp8_e4m3"]["ratio"] >= 1.08
    assert all(x["encode_gbps"] > 0 and x["decode_gbps"] > 0 and x["memcpy_gbps"] > 0 for x in r["rows"].values())
