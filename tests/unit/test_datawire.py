"""The data channel's wire format alone (``kvstore.wire.data``): encodings round-trip, and
every malformed fixed part is a ``WireError`` (a ``ConfigError``: INVALID_ARGUMENT)."""

import struct

import pytest

from kvstore.errors import ConfigError
from kvstore.keys import ROOT
from kvstore.wire import data as wire
from tests.kits import chain as kv

KEY = kv.keys_of(kv.namespace("datawire"), 1)[0]
TICKET = bytes(range(32))


def test_hello_round_trips_with_and_without_a_token():
    for token, raw in (("s3cret", b"s3cret"), (None, b""), ("", b"")):
        hello = wire.encode_hello(TICKET, token)
        assert wire.decode_hello(hello[: wire.HELLO.size]) == (TICKET, len(raw))
        assert hello[wire.HELLO.size :] == raw


def test_requests_round_trip():
    get = wire.encode_request(wire.Op.GET, KEY)
    head = wire.decode_request(get[: wire.REQUEST.size])
    assert (head.op, head.key_len, head.size, head.parent) == (wire.Op.GET, len(KEY), 0, b"")
    assert get[wire.REQUEST.size :] == KEY
    parent = bytes(range(100, 132))
    put = wire.encode_request(wire.Op.PUT, KEY, 5 << 30, parent)
    head = wire.decode_request(put[: wire.REQUEST.size])
    assert (head.op, head.size, head.parent) == (wire.Op.PUT, 5 << 30, parent)
    root_parent = wire.decode_request(wire.encode_request(wire.Op.PUT, KEY, 10, bytes(ROOT))[: wire.REQUEST.size])
    assert root_parent.parent == (b"" if bytes(ROOT) == wire.NO_PARENT else bytes(ROOT))


def test_replies_round_trip_and_cut_long_messages():
    raw = wire.encode_reply(code=7, flag=1, tier=2, length=123, message="why")
    head = wire.decode_reply(raw[: wire.REPLY.size])
    assert (head.code, head.flag, head.tier, head.length, head.message_len) == (7, 1, 2, 123, 3)
    assert raw[wire.REPLY.size :] == b"why"
    long = wire.encode_reply(code=3, message="x" * 10_000)
    assert wire.decode_reply(long[: wire.REPLY.size]).message_len == wire.MAX_MESSAGE_BYTES
    assert len(long) == wire.REPLY.size + wire.MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    "raw,why",
    [
        (struct.pack("<4sH32s", b"HTTP", 0, TICKET), "not a kvstore data channel client"),
        (struct.pack("<4sH32s", b"KVD1", 5000, TICKET), "token of 5000 bytes"),
    ],
)
def test_bad_hellos(raw, why):
    with pytest.raises(wire.WireError, match=why):
        wire.decode_hello(raw)


@pytest.mark.parametrize(
    "fields,why",
    [
        ((ord("X"), 10, 0, 0, wire.NO_PARENT), "op 88"),
        ((ord("G"), 0, 0, 0, wire.NO_PARENT), "key length 0"),
        ((ord("G"), 10, 1, 0, wire.NO_PARENT), "op 71"),  # the reserved u16 is not 0
        ((ord("G"), 10, 0, 99, wire.NO_PARENT), "no size and no parent"),
        ((ord("G"), 10, 0, 0, b"\x01" * 32), "no size and no parent"),
    ],
)
def test_bad_requests(fields, why):
    with pytest.raises(wire.WireError, match=why):
        wire.decode_request(wire.REQUEST.pack(*fields))


def test_bad_replies_and_arguments():
    with pytest.raises(wire.WireError, match="message of 5000 bytes"):
        wire.decode_reply(wire.REPLY.pack(0, 0, 0, 5000, 0))
    for call, why in (
        (lambda: wire.encode_hello(b"short", None), "32 bytes"),
        (lambda: wire.encode_hello(TICKET, "t" * 5000), "longer than"),
        (lambda: wire.encode_request(wire.Op.GET, b""), "0 bytes"),
        (lambda: wire.encode_request(wire.Op.PUT, KEY, 10, b"short"), "parent hash"),
    ):
        with pytest.raises(ConfigError, match=why):
            call()
