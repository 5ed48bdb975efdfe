"""Encryption at rest, the object part (kvstore.integrity.encrypt / decrypt_in_place, the
codec's encrypted flag): the copy holds no plaintext and decrypts back bit for bit; a changed
byte, a moved ciphertext, another tenant's key and a retired key id are refused; lz4 then
AES composes.  Pure CPU, well under a second."""

import dataclasses

import numpy as np
import pytest

from kvstore import codec, integrity
from kvstore.errors import ConfigError, CorruptHeaderError
from kvstore.integrity import ForgedObjectError
from kvstore.keys import ChunkHash, Namespace, ObjectKey

GEOMETRY = codec.ObjectGeometry(2, 4, 1024)
KEY = ObjectKey(Namespace(bytes(range(32))), ChunkHash(bytes(range(1, 33))), "r0")
OTHER = ObjectKey(Namespace(bytes(range(32))), ChunkHash(bytes(range(2, 34))), "r0")
PATTERN = b"PLAINTEXT-KV-PAGE"


def sealed(ring, key=KEY) -> bytearray:
    """A sealed object whose payload repeats ``PATTERN`` (easy to search for)."""
    payload = (PATTERN * (GEOMETRY.payload_bytes // len(PATTERN) + 1))[: GEOMETRY.payload_bytes]
    buf = bytearray(codec.object_size(GEOMETRY))
    codec.encode_into(buf, key, GEOMETRY, payload)
    integrity.seal(buf, ring)
    return buf


def _enc(obj, ring) -> bytearray:
    return bytearray(integrity.encrypt(obj, ring))


def test_the_encrypted_copy_holds_no_plaintext_and_decrypts_to_the_sealed_object():
    ring = integrity.new_deployment().keyring("a")
    plain = sealed(ring)
    enc = _enc(plain, ring)
    assert PATTERN in plain and PATTERN not in enc
    header = codec.verify(enc, expected_key=KEY, length=len(enc))  # a tier's check passes
    assert header.encrypted and header.key_id == 1 and len(enc) == len(plain) + codec.AEAD_OVERHEAD
    assert _enc(plain, ring)[codec.HEADER_SIZE :] != enc[codec.HEADER_SIZE :]  # a fresh nonce
    reused = bytearray(len(enc) + 100)
    assert len(integrity.encrypt(plain, ring, reused)) == len(enc)
    assert integrity.decrypt_in_place(reused, ring).total_len == len(plain) and reused[: len(plain)] == plain
    with pytest.raises(ConfigError, match="cannot hold"):
        integrity.encrypt(plain, ring, bytearray(len(enc) - 1))
    back = integrity.decrypt_in_place(enc, ring)
    assert back.total_len == len(plain) and enc[: len(plain)] == plain
    integrity.check(enc[: len(plain)], ring)


@pytest.mark.parametrize("payload_bytes", [1, (1 << 20) - 1, 1 << 20, 3 * (1 << 20) + 5])
def test_objects_of_many_pieces_decrypt_in_place_and_a_late_change_is_refused(payload_bytes):
    """``decrypt_in_place`` works through a scratch buffer a MiB at a time (cryptography 51
    refuses overlapping buffers): payloads around and across the piece size come back whole,
    and a byte changed in the last piece still fails the tag."""
    ring = integrity.new_deployment().keyring("a")
    geometry = codec.ObjectGeometry(1, 1, payload_bytes, dtype="uint8")
    plain = bytearray(codec.object_size(geometry))
    codec.encode_into(plain, KEY, geometry, np.random.default_rng(payload_bytes).bytes(payload_bytes))
    integrity.seal(plain, ring)
    enc = _enc(plain, ring)
    assert integrity.decrypt_in_place(bytearray(enc), ring).total_len == len(plain)
    back = bytearray(enc)
    integrity.decrypt_in_place(back, ring)
    assert back[: len(plain)] == plain
    enc[codec.HEADER_SIZE + payload_bytes - 1] ^= 1
    with pytest.raises(ForgedObjectError):
        integrity.decrypt_in_place(enc, ring)


@pytest.mark.parametrize("where", ["payload", "tag", "nonce", "header field"])
def test_a_changed_byte_is_refused_even_with_valid_checksums(where):
    ring = integrity.new_deployment().keyring("a")
    enc = _enc(sealed(ring), ring)
    header = codec.decode_header(enc)
    end = header.total_len
    at = {"payload": codec.HEADER_SIZE + 7, "tag": end - codec.AEAD_OVERHEAD + 3, "nonce": end - 2}.get(where)
    if at is None:  # the parent: a header field the MAC and the tag both cover
        enc[: codec.HEADER_SIZE] = codec.pack_header(dataclasses.replace(header, parent=OTHER.chunk_hash))
    else:
        enc[at] ^= 0x01
        enc[: codec.HEADER_SIZE] = codec.with_payload(
            header, True, header.stored_len, codec.checksum(memoryview(enc)[codec.HEADER_SIZE : end])
        )
    codec.verify(enc, expected_key=KEY)  # damage checks cannot see it
    with pytest.raises(ForgedObjectError, match="tag mismatch"):
        integrity.decrypt_in_place(enc, ring)


def test_a_ciphertext_moved_from_another_object_is_refused():
    ring = integrity.new_deployment().keyring("a")
    mine, theirs = _enc(sealed(ring), ring), _enc(sealed(ring, OTHER), ring)
    header = codec.decode_header(mine)
    mine[codec.HEADER_SIZE :] = theirs[codec.HEADER_SIZE :]
    mine[: codec.HEADER_SIZE] = codec.with_payload(
        header, True, header.stored_len, codec.checksum(memoryview(mine)[codec.HEADER_SIZE :])
    )
    codec.verify(mine, expected_key=KEY)
    with pytest.raises(ForgedObjectError, match="tag mismatch"):
        integrity.decrypt_in_place(mine, ring)


def test_another_tenants_or_deployments_key_cannot_decrypt_and_keys_are_separate():
    dep = integrity.new_deployment()
    a, b = dep.keyring("a"), dep.keyring("b")
    assert a.cipher_key(1) not in (b.cipher_key(1), a.keys[1])
    enc = _enc(sealed(a), a)
    for ring in (b, integrity.new_deployment().keyring("a")):
        with pytest.raises(ForgedObjectError, match="tag mismatch"):
            integrity.decrypt_in_place(bytearray(enc), ring)


def test_rotation_old_ids_decrypt_until_retired(tmp_path):
    dep = integrity.new_deployment()
    old = dep.keyring("a")
    enc = _enc(sealed(old), old)
    dep.secrets[2] = bytes(range(32))
    dep.current = 2
    rotated = dep.keyring("a")
    fresh = _enc(sealed(rotated), rotated)
    assert codec.decode_header(fresh).key_id == 2
    integrity.decrypt_in_place(bytearray(enc), rotated)  # id 1 still held: reads
    del dep.secrets[1]
    with pytest.raises(ForgedObjectError, match="does not hold"):
        integrity.decrypt_in_place(bytearray(enc), dep.keyring("a"))


def test_compress_then_encrypt_round_trips():
    ring = integrity.new_deployment().keyring("a")
    plain = sealed(ring)
    packed = codec.compress(plain)
    enc = _enc(packed, ring)
    assert codec.decode_header(enc).codec is codec.Codec.LZ4 and len(enc) == len(packed) + codec.AEAD_OVERHEAD
    integrity.decrypt_in_place(enc, ring)
    out = bytearray(len(plain))
    codec.decompress_into(enc[: len(packed)], out)
    assert out == plain


def test_what_cannot_be_encrypted_or_decoded_says_so():
    ring = integrity.new_deployment().keyring("a")
    unsealed = bytearray(codec.object_size(GEOMETRY))
    codec.encode_into(unsealed, KEY, GEOMETRY, bytes(GEOMETRY.payload_bytes))
    with pytest.raises(ConfigError, match="only a sealed, unencrypted object"):
        _enc(unsealed, ring)
    enc = _enc(sealed(ring), ring)
    with pytest.raises(ConfigError, match="only a sealed, unencrypted object"):
        _enc(enc, ring)
    with pytest.raises(ConfigError, match="MAC is computed over an uncompressed, unencrypted"):
        integrity.check(enc, ring)
    with pytest.raises(ConfigError, match="is encrypted: decrypt it first"):
        codec.decompress_into(enc, bytearray(len(enc)))
    with pytest.raises(ConfigError, match="is not encrypted"):
        integrity.decrypt_in_place(sealed(ring), ring)
    head = bytearray(codec.pack_header(codec.decode_header(enc)))
    head[10] = 0x02  # an unknown flag bit
    head[-8:] = codec._CHECK.pack(__import__("xxhash").xxh3_64_intdigest(bytes(head[:-8])))
    with pytest.raises(CorruptHeaderError, match="unknown header flags"):
        codec.decode_header(head)


def test_an_encrypting_keyring_is_the_same_keys_with_the_flag():
    ring = integrity.new_deployment().keyring("a")
    on = ring.encrypting(True)
    assert on.encrypt and not ring.encrypt and on.keys == ring.keys and ring.encrypting(False) is ring
    assert "encrypt=True" in repr(on) and on.cipher_key(1).hex() not in repr(on)
    assert np.frombuffer(on.cipher_key(1), np.uint8).any()
