"""Every encoder of ``kvstore.wire`` is read back by its decoder (and the hand-made protobuf
varints by protobuf's own): ``proto`` and ``shm`` here; ``data`` in test_datawire.py and
``kv`` in test_kv_events.py (decoded with vLLM's own structs).  Cost: well under a second."""

from __future__ import annotations

import dataclasses
import os

import pytest
from google.protobuf.internal.decoder import _DecodeVarint
from google.protobuf.internal.encoder import _VarintBytes

from kvstore.errors import ConfigError
from kvstore.wire import shm
from kvstore.wire.data import HELLO, TICKET_SIZE
from kvstore.wire.proto import read_varint, varint

VALUES = [0, 1, 127, 128, 300, 16_383, 16_384, 2**31 - 1, 2**32, 2**63 - 1, 2**64 - 1]


@pytest.mark.parametrize("n", VALUES)
def test_varints_are_protobufs_own_and_read_back(n):
    assert varint(n) == _VarintBytes(n)
    assert _DecodeVarint(varint(n), 0) == (n, len(varint(n)))
    buf = b"\xff" + varint(n) + b"\x01"
    assert read_varint(buf, 1) == (n, 1 + len(varint(n)))


def test_a_truncated_or_overlong_varint_raises_the_callers_error():
    with pytest.raises(KeyError, match="truncated"):
        read_varint(varint(300)[:1], 0, KeyError)
    with pytest.raises(ValueError, match="truncated"):
        read_varint(b"\x80" * 11, 0)


def test_a_gate_hello_reads_back():
    ticket = os.urandom(TICKET_SIZE)
    hello = shm.encode_hello(ticket, "tok-é")
    assert shm.decode_hello(hello[: HELLO.size]) == (ticket, len("tok-é".encode()))
    assert hello[HELLO.size :] == "tok-é".encode()
    with pytest.raises(shm.ShmWireError, match="magic"):
        shm.decode_hello(b"XXXX" + hello[4 : HELLO.size])


@pytest.mark.parametrize(
    "code,writable,session,size,message",
    [(0, True, 7, 1 << 30, ""), (7, False, 0, 0, "uid 65534 may not map this store's memory")],
)
def test_a_gate_reply_reads_back(code, writable, session, size, message):
    raw = shm.encode_reply(code, writable, session, size, message)
    reply = shm.decode_reply(raw[: shm.REPLY.size])
    assert (reply.code, reply.writable, reply.session, reply.pool_size) == (code, writable, session, size)
    assert raw[shm.REPLY.size : shm.REPLY.size + reply.message_len].decode() == message


def test_a_malformed_gate_reply_is_refused():
    raw = bytearray(shm.encode_reply(0, True, 1, 4096))
    raw[1] = 2  # writable must be 0 or 1
    with pytest.raises(shm.ShmWireError, match="malformed"):
        shm.decode_reply(bytes(raw[: shm.REPLY.size]))


def test_a_gate_reply_carries_its_features_and_ignores_unknown_ones():
    reply = shm.decode_reply(shm.encode_reply(0, True, 3, 4096, features=shm.FEATURE_LEASES)[: shm.REPLY.size])
    assert reply.serves_leases and reply.features == shm.FEATURE_LEASES
    assert not shm.decode_reply(shm.encode_reply(0, True, 3, 4096)[: shm.REPLY.size]).serves_leases
    later = shm.decode_reply(shm.encode_reply(0, True, 3, 4096, features=0b110)[: shm.REPLY.size])
    assert not later.serves_leases  # a bit of a later server: not one this client acts on


def test_a_lease_request_and_its_answer_read_back():
    key = bytes(range(64)) + b"r0"
    raw = shm.encode_lease(key, 250, 2**64 - 1)
    assert shm.decode_lease_head(raw[: shm.LEASE.size]) == (len(key), 250, 2**64 - 1)
    assert raw[shm.LEASE.size :] == key
    for answer in (
        shm.Leased(9, found=True, tier=2, lease_ms=5000, offset=1 << 33, length=12345, lease_id=77),
        shm.Leased(10),  # a miss
        shm.Leased(11, code=8, message="tenant 'b' holds its most leases (4)"),
    ):
        raw = shm.encode_leased(answer)
        head, message_len = shm.decode_leased_head(raw[: shm.LEASED.size])
        text = raw[shm.LEASED.size : shm.LEASED.size + message_len].decode()
        assert head == dataclasses.replace(answer, message="") and text == answer.message


@pytest.mark.parametrize(
    "raw,match",
    [
        (shm.LEASE.pack(ord("X"), 66, 0, 0, 1), "not a lease request"),
        (shm.LEASE.pack(shm.LEASE_OP, 0, 0, 0, 1), "key length 0"),
        (shm.LEASE.pack(shm.LEASE_OP, shm.MAX_KEY_BYTES + 1, 0, 0, 1), "key length"),
        (shm.LEASE.pack(shm.LEASE_OP, 66, 1, 0, 1), "malformed"),
    ],
)
def test_a_malformed_lease_request_is_refused(raw, match):
    with pytest.raises(shm.ShmWireError, match=match):
        shm.decode_lease_head(raw)


def test_an_answer_that_is_found_and_an_error_at_once_is_refused():
    raw = shm.LEASED.pack(8, 1, 0, 0, 1, 0, 10, 3, 0)
    with pytest.raises(shm.ShmWireError, match="malformed"):
        shm.decode_leased_head(raw)
    with pytest.raises(ConfigError, match="key of 1-128 bytes"):
        shm.encode_lease(b"", 0, 1)
