"""The object format (docs/architecture.md#object-format), without any I/O: seal, verify,
and catch every kind of damage.

The story: a chunk's pages are sealed in a caller's buffer behind a 256-byte header.  Any
byte that changes afterwards — in the header or in the payload — must be caught by
``verify()`` as a specific ``ObjectFormatError`` (a counted miss), never reach the engine.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvstore import codec
from kvstore.codec import (
    HEADER_SIZE,
    Codec,
    ObjectGeometry,
    ObjectHeader,
    compress,
    decode_header,
    decompress_into,
    encode_into,
    layer_view,
    object_size,
    pack_header,
    payload_view,
    sample_ratio,
    verify,
)
from kvstore.errors import ChecksumMismatchError, ConfigError, CorruptHeaderError, KeyMismatchError, ObjectFormatError
from kvstore.keys import ROOT, Identity, ObjectKey, chunk_hashes

NS = Identity(
    model="tiny", revision="r", kv_dtype="bf16", layout_id="cpu:LBHNC:bs128", num_layers=4, num_kv_heads=2, head_dim=64
).namespace()
H = chunk_hashes(NS, list(range(64)), 16)
KEY = ObjectKey(NS, H[1], "r0")


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def sealed(geometry: ObjectGeometry, payload: bytes | None = None, key: ObjectKey = KEY, parent=H[0]) -> bytearray:
    payload = random_bytes(geometry.payload_bytes) if payload is None else payload
    buf = bytearray(object_size(geometry))
    encode_into(buf, key, geometry, payload, parent=parent)
    return buf


GEOMETRIES = [
    ObjectGeometry(1, 1, 16),
    ObjectGeometry(2, 3, 64, "fp16"),
    ObjectGeometry(4, 2, 256, "fp8_e4m3", "cpu:LBHNC:bs128", num_tokens=16),
    ObjectGeometry(3, 1, 4096, "fp32", "x" * 32, num_tokens=128),
]


# ---- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g.num_layers}x{g.pages_per_layer}x{g.page_bytes}")
def test_encode_then_verify_round_trips_header_and_payload(geometry):
    payload = random_bytes(geometry.payload_bytes, seed=geometry.page_bytes)
    buf = bytearray(object_size(geometry))
    header = encode_into(buf, KEY, geometry, payload, parent=H[0])
    assert len(buf) == HEADER_SIZE + geometry.payload_bytes
    got = verify(buf, expected_key=KEY, length=len(buf))
    assert got == header == decode_header(buf)
    assert (got.key, got.parent, got.geometry, got.codec) == (KEY, H[0], geometry, Codec.NONE)
    assert got.raw_len == got.stored_len == geometry.payload_bytes
    assert got.total_len == len(buf)
    assert bytes(payload_view(buf, got)) == payload
    for layer in range(geometry.num_layers):
        lo = layer * geometry.layer_bytes
        assert bytes(layer_view(buf, geometry, layer)) == payload[lo : lo + geometry.layer_bytes]


def test_payload_written_in_place_before_sealing():
    """Gather straight into the slot, then seal without a payload argument."""
    g = GEOMETRIES[2]
    payload = random_bytes(g.payload_bytes, seed=7)
    buf = bytearray(object_size(g))
    buf[HEADER_SIZE:] = payload
    header = encode_into(buf, KEY, g)
    assert verify(buf, KEY) == header and header.parent == ROOT
    assert bytes(buf) == bytes(sealed(g, payload, parent=ROOT))


def test_encoding_is_deterministic_and_works_in_numpy_and_larger_slots():
    g = GEOMETRIES[1]
    payload = random_bytes(g.payload_bytes, seed=3)
    a = sealed(g, payload)
    slot = np.zeros(object_size(g) + 100, dtype=np.uint8)  # a host slot bigger than the object
    encode_into(slot, KEY, g, np.frombuffer(payload, dtype=np.uint8), parent=H[0])
    assert slot.tobytes()[: len(a)] == bytes(a)
    assert verify(slot, KEY).total_len == len(a)
    with pytest.raises(CorruptHeaderError):
        verify(slot, KEY, length=len(slot))  # the caller's length disagrees with the header


def test_header_fields_change_the_sealed_bytes():
    g = GEOMETRIES[1]
    payload = random_bytes(g.payload_bytes)
    base = bytes(sealed(g, payload))
    variants = [
        sealed(g, payload, key=ObjectKey(NS, H[1], "r1")),
        sealed(g, payload, parent=ROOT),
        sealed(ObjectGeometry(2, 3, 64, "bf16"), payload),
        sealed(ObjectGeometry(2, 3, 64, "fp16", num_tokens=48), payload),
        sealed(ObjectGeometry(2, 3, 64, "fp16", "other"), payload),
        sealed(ObjectGeometry(3, 2, 64, "fp16"), payload),
    ]
    assert all(bytes(v[:HEADER_SIZE]) != base[:HEADER_SIZE] for v in variants)
    assert all(bytes(v[HEADER_SIZE:]) == base[HEADER_SIZE:] for v in variants)


# ---- every single-byte corruption is caught -------------------------------------------------

SMALL = ObjectGeometry(2, 2, 1024)  # 4 KiB payload


def test_every_single_byte_header_corruption_is_a_corrupt_header():
    buf = sealed(SMALL)
    clean = bytes(buf)
    missed, checked = [], 0
    for pos in range(HEADER_SIZE):
        for mask in (0x01, 0x80, 0xFF, (pos * 37) % 255 + 1):
            buf[pos] ^= mask
            try:
                verify(buf, KEY)
                missed.append((pos, mask, "accepted"))
            except CorruptHeaderError:
                pass
            except ObjectFormatError as err:
                missed.append((pos, mask, type(err).__name__))
            buf[pos] ^= mask
            checked += 1
    assert bytes(buf) == clean
    assert checked == HEADER_SIZE * 4
    assert missed == []


def test_every_single_byte_payload_corruption_of_a_small_object_is_a_checksum_mismatch():
    buf = sealed(SMALL)
    missed = []
    for pos in range(HEADER_SIZE, len(buf)):
        mask = 1 << (pos % 8)  # every bit position, spread over the payload
        buf[pos] ^= mask
        try:
            verify(buf, KEY)
            missed.append(pos)
        except ChecksumMismatchError:
            pass
        buf[pos] ^= mask
    assert SMALL.payload_bytes == 4096
    assert missed == []
    verify(buf, KEY)  # and the restored object is whole again


def test_sampled_payload_corruptions_of_a_large_object_are_checksum_mismatches():
    big = ObjectGeometry(32, 16, 16 * 1024)  # 8 MiB, one layer = 256 KiB
    buf = sealed(big)
    end = len(buf)
    boundaries = [HEADER_SIZE + layer * big.layer_bytes + d for layer in range(1, 32) for d in (-1, 0)]
    rng = np.random.default_rng(42)
    positions = [HEADER_SIZE, end - 1, *boundaries, *rng.integers(HEADER_SIZE, end, 120).tolist()]
    missed = []
    for pos in positions:
        buf[pos] ^= 0x5A
        try:
            verify(buf, KEY)
            missed.append(pos)
        except ChecksumMismatchError:
            pass
        buf[pos] ^= 0x5A
    assert missed == []
    assert verify(buf, KEY).raw_len == 8 << 20


# ---- truncation, wrong key, wrong length ----------------------------------------------------


@pytest.mark.parametrize("keep", [0, 1, 4, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, -1])
def test_truncated_objects_are_corrupt(keep):
    buf = sealed(SMALL)
    cut = bytes(buf[:keep])
    with pytest.raises(CorruptHeaderError):
        verify(cut)


@pytest.mark.parametrize(
    "other",
    [
        ObjectKey(NS, H[1], "r1"),
        ObjectKey(NS, H[2], "r0"),
        ObjectKey(NS.scoped("t"), H[1], "r0"),
    ],
    ids=["tag", "chunk", "namespace"],
)
def test_an_intact_object_of_another_key_is_a_key_mismatch(other):
    buf = sealed(SMALL)
    with pytest.raises(KeyMismatchError):
        verify(buf, expected_key=other)
    assert verify(buf, expected_key=KEY).key == KEY


@pytest.mark.parametrize("delta", [-1, 1, -HEADER_SIZE, 4096])
def test_a_wrong_length_argument_is_corrupt(delta):
    buf = sealed(SMALL)
    with pytest.raises(CorruptHeaderError):
        verify(buf, length=len(buf) + delta)


def test_an_object_in_a_larger_buffer_verifies_with_its_own_length():
    buf = sealed(SMALL) + bytearray(b"\xee" * 64)
    assert verify(buf, KEY, length=object_size(SMALL)).total_len == object_size(SMALL)


# ---- bad arguments are configuration errors ------------------------------------------------


@pytest.mark.parametrize("spare", [1, HEADER_SIZE, object_size(SMALL)])
def test_a_buffer_too_small_for_encode_into_is_a_config_error_and_is_left_untouched(spare):
    buf = bytearray(object_size(SMALL) - spare)
    with pytest.raises(ConfigError):
        encode_into(buf, KEY, SMALL, random_bytes(SMALL.payload_bytes))
    assert not any(buf)


@pytest.mark.parametrize("n", [0, 1, SMALL.payload_bytes - 1, SMALL.payload_bytes + 1])
def test_a_payload_of_the_wrong_length_is_a_config_error(n):
    buf = bytearray(object_size(SMALL) + 8)
    with pytest.raises(ConfigError):
        encode_into(buf, KEY, SMALL, bytes(n))
    assert not any(buf)


@pytest.mark.parametrize(
    "args, kw",
    [
        ((0, 1, 1), {}),
        ((1, 0, 1), {}),
        ((1, 1, 0), {}),
        ((-1, 1, 1), {}),
        ((1, -2, 1), {}),
        ((1, 1, -64), {}),
        ((1, 1, 1), {"dtype": "int4"}),
        ((1, 1, 1), {"dtype": ""}),
        ((1, 1, 1), {"dtype": "BF16"}),
        ((1, 1, 1), {"layout_id": ""}),
        ((1, 1, 1), {"layout_id": "x" * 33}),
        ((1 << 20, 1 << 10, 1 << 11), {}),  # 2 TiB
    ],
    ids=[
        "layers0",
        "pages0",
        "bytes0",
        "layers-",
        "pages-",
        "bytes-",
        "int4",
        "empty-dtype",
        "upper-dtype",
        "empty-layout",
        "long-layout",
        "over-1TiB",
    ],
)
def test_invalid_geometry_is_a_config_error(args, kw):
    with pytest.raises(ConfigError):
        ObjectGeometry(*args, **kw)


def test_geometry_arithmetic():
    g = ObjectGeometry(4, 2, 256)
    assert (g.layer_bytes, g.payload_bytes, object_size(g)) == (512, 2048, 2048 + 256)
    assert ObjectGeometry(1, 1, 1).payload_bytes == 1


def test_errors_form_one_hierarchy():
    for err in (CorruptHeaderError, ChecksumMismatchError, KeyMismatchError):
        assert issubclass(err, ObjectFormatError)
    assert issubclass(ConfigError, ValueError)


# ---- lz4 -----------------------------------------------------------------------------------


def compressible_payload(g: ObjectGeometry) -> bytes:
    """Half zeros, half a repeating pattern: lz4 shrinks it a lot."""
    n = g.payload_bytes
    return bytes(n // 2) + (b"kvcache!" * n)[: n - n // 2]


def test_lz4_round_trip_restores_the_exact_object():
    g = ObjectGeometry(4, 2, 1024)
    original = sealed(g, compressible_payload(g))
    packed = compress(original)
    header = verify(packed, KEY, length=len(packed))
    assert header.codec is Codec.LZ4 and header.raw_len == g.payload_bytes
    assert header.stored_len == len(packed) - HEADER_SIZE < g.payload_bytes // 4
    assert (header.key, header.parent, header.geometry) == (KEY, H[0], g)
    out = bytearray(object_size(g))
    restored = decompress_into(packed, out)
    assert bytes(out) == bytes(original)
    assert restored == verify(original)


def test_decompress_into_copies_an_uncompressed_object():
    g = GEOMETRIES[1]
    original = sealed(g)
    out = bytearray(object_size(g) + 10)
    assert decompress_into(original, out) == verify(original)
    assert bytes(out[: len(original)]) == bytes(original) and not any(out[len(original) :])


def test_lz4_compresses_random_pages_without_loss():
    g = GEOMETRIES[2]
    original = sealed(g)
    out = bytearray(object_size(g))
    decompress_into(compress(original), out)
    assert out == original


def test_every_byte_of_a_compressed_payload_is_protected():
    g = ObjectGeometry(2, 2, 512)
    packed = bytearray(compress(sealed(g, compressible_payload(g))))
    out = bytearray(object_size(g))
    missed = []
    for pos in range(HEADER_SIZE, len(packed)):
        packed[pos] ^= 0x20
        try:
            decompress_into(packed, out)
            missed.append(pos)
        except ChecksumMismatchError:
            pass
        packed[pos] ^= 0x20
    assert len(packed) > HEADER_SIZE and missed == []
    with pytest.raises(CorruptHeaderError):
        packed[20] ^= 1
        decompress_into(packed, out)


def forged_lz4(g: ObjectGeometry, stream: bytes) -> bytes:
    """A header that honestly checksums a dishonest lz4 stream (a buggy or hostile writer)."""
    header = ObjectHeader(KEY, H[0], g, Codec.LZ4, g.payload_bytes, len(stream), codec.checksum(stream))
    return pack_header(header) + stream


@pytest.mark.parametrize(
    "stream",
    [
        b"\xff" * 40,  # not lz4 at all
        b"",  # nothing
    ],
    ids=["garbage", "empty"],
)
def test_an_undecodable_lz4_stream_is_a_checksum_mismatch(stream):
    g = ObjectGeometry(2, 2, 512)
    with pytest.raises(ChecksumMismatchError):
        decompress_into(forged_lz4(g, stream), bytearray(object_size(g)))


def test_an_lz4_stream_of_the_wrong_size_is_a_checksum_mismatch_not_a_config_error():
    import lz4.block

    g = ObjectGeometry(2, 2, 512)
    short = lz4.block.compress(bytes(100), store_size=False)  # valid, but 100 bytes, not 2048
    with pytest.raises(ChecksumMismatchError):
        decompress_into(forged_lz4(g, short), bytearray(object_size(g)))


def test_compressing_twice_or_into_a_small_buffer_is_a_config_error():
    g = ObjectGeometry(2, 2, 512)
    original = sealed(g, compressible_payload(g))
    packed = compress(original)
    with pytest.raises(ConfigError):
        compress(packed)
    for obj in (original, packed):
        with pytest.raises(ConfigError):
            decompress_into(obj, bytearray(object_size(g) - 1))


def test_sample_ratio_measures_instead_of_assuming():
    noise = random_bytes(1 << 20, seed=9)
    assert 0.98 < sample_ratio(noise) <= 1.0
    assert sample_ratio(bytes(1 << 20)) > 2
    assert sample_ratio(bytes(64 << 10) + noise, sample_bytes=64 << 10) > 2  # only the sample
    assert sample_ratio(noise + bytes(1 << 20), sample_bytes=1 << 20) <= 1.0


def test_generated_tokens_travel_in_the_header_and_survive_rekey_and_lz4():
    g = codec.ObjectGeometry(2, 2, 64, "bf16", "t", 256)
    buf = bytearray(codec.object_size(g))
    codec.encode_into(buf, KEY, g, bytes(range(256)) * 1, H[0], generated=100)
    assert codec.verify(buf).generated == 100
    other = ObjectKey(KEY.namespace, H[1])
    assert codec.rekey(buf, other).generated == 100 and codec.verify(buf, expected_key=other).generated == 100
    packed = codec.compress(buf)
    out = bytearray(len(buf))
    assert codec.decompress_into(packed, out).generated == 100


def test_older_objects_read_as_all_prompt_and_a_count_above_the_tokens_is_damage():
    g = codec.ObjectGeometry(2, 2, 64, "bf16", "t", 256)
    buf = bytearray(codec.object_size(g))
    codec.encode_into(buf, KEY, g, bytes(256), H[0])
    assert codec.verify(buf).generated == 0  # zero bytes there: no generated tokens
    header = codec.decode_header(buf)
    forged = codec.pack_header(dataclasses.replace(header, generated=257))
    buf[: codec.HEADER_SIZE] = forged
    with pytest.raises(CorruptHeaderError, match="generated"):
        codec.decode_header(buf)
