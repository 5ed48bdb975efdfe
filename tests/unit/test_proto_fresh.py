"""The committed gRPC code matches ``proto/`` (``make proto`` regenerates it), and the server's
hand-written frame codec (``kvstore.server.wire``) matches protobuf byte for byte."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore._proto import generate
from kvstore._proto import kvstore_pb2 as pb
from kvstore.server.wire import InFrame, Malformed, OutFrame, decode_put_frame, encode_get_frame, generic_handler


def test_generated_code_is_fresh(tmp_path):
    fresh = generate.generate(Path(tmp_path))
    assert set(fresh) == set(generate.FILES)
    for name, text in fresh.items():
        committed = (generate.OUT_DIR / name).read_text()
        assert committed == text, f"kvstore/_proto/{name} is stale: run `make proto`"


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(max_size=3000),
    offset=st.integers(0, 2**64 - 1),
    total=st.integers(0, 2**64 - 1),
    found=st.booleans(),
    tier=st.sampled_from([0, 1, 2, 3]),
)
def test_out_frame_encodes_like_protobuf(data, offset, total, found, tier):
    raw = encode_get_frame(OutFrame(memoryview(data), offset, found, total, tier))
    expected = pb.GetFrame(found=found, total_length=total, offset=offset, data=data, tier=tier)
    assert raw == expected.SerializeToString()
    assert pb.GetFrame.FromString(raw) == expected


def test_pb_frames_pass_through():
    frame = pb.GetFrame(found=False)
    assert encode_get_frame(frame) == frame.SerializeToString()


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=3000))
def test_data_frames_decode_without_copy(data):
    raw = pb.PutFrame(data=data).SerializeToString()
    frame = decode_put_frame(raw)
    assert isinstance(frame, InFrame) and frame.start is None
    assert bytes(frame.data) == data
    assert frame.data.obj is raw  # a view of the received message


def test_start_frame_and_odd_frames():
    start = pb.PutStartRequest(namespace=b"n" * 32, chunk_hash=b"h" * 32, tag="r0", size=1000)
    frame = decode_put_frame(pb.PutFrame(start=start).SerializeToString())
    assert frame.start == start and frame.data is None
    assert decode_put_frame(b"") == InFrame()  # neither start nor data
    # data repeated: protobuf keeps the last one; so does the slow path
    twice = pb.PutFrame(data=b"aa").SerializeToString() + pb.PutFrame(data=b"bbb").SerializeToString()
    assert bytes(decode_put_frame(twice).data) == b"bbb"


@pytest.mark.parametrize("raw", [b"\x12\x05ab", b"\x12", b"\x0a\x03\x1a\x01\xff", b"\xff\xff\xff"])
def test_garbage_is_malformed_not_an_exception(raw):
    frame = decode_put_frame(raw)
    assert isinstance(frame, Malformed) and frame.method == "PutStream"


def test_every_rpc_of_the_proto_needs_a_handler():
    class Partial:
        async def Hello(self, request, context):
            return pb.HelloResponse()

    with pytest.raises(RuntimeError, match="lacks RPC Lookup"):
        generic_handler(Partial())
