"""Helpers for tests against a real ``kvstore serve`` child: valid objects made in reused
buffers, a small synchronous client over the raw generated stubs (shared memory through a
session with the server's gate, ``ShmSession``, or streams), tokens files and polling.

The client here is deliberately plain (no retries, no breaker): tests assert exact status
codes, so every ``grpc.RpcError`` reaches them untouched.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import yaml

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.shmsession import ShmSession
from kvstore.keys import ROOT, ChunkHash, Namespace, ObjectKey
from kvstore.localtoken import local_token

KiB, MiB = 1 << 10, 1 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * MiB), ("grpc.max_send_message_length", 64 * MiB)]
_BLOCK = 1 * MiB


def random_key(rng: np.random.Generator, tag: str = "r0", namespace: Namespace | None = None) -> ObjectKey:
    ns = namespace if namespace is not None else Namespace(rng.bytes(32))
    return ObjectKey(ns, ChunkHash(rng.bytes(32)), tag)


def chain_keys(rng: np.random.Generator, n: int, tag: str = "r0") -> list[ObjectKey]:
    """``n`` keys of one namespace (a chain as far as the store is concerned)."""
    ns = Namespace(rng.bytes(32))
    return [ObjectKey(ns, ChunkHash(rng.bytes(32)), tag) for _ in range(n)]


class Objects:
    """Valid objects of any size ≥ 257 bytes, made in ONE reused buffer: the view ``make``
    returns is valid until the next ``make``.  The payload is a 1 MiB random block (from the
    seed) tiled, so objects of different seeds differ everywhere."""

    def __init__(self, max_size: int) -> None:
        self.buf = np.zeros(max_size, np.uint8)

    def make(self, key: ObjectKey, size: int, seed: int = 0, parent: ChunkHash = ROOT) -> memoryview:
        n = size - codec.HEADER_SIZE
        block = np.random.default_rng(seed).integers(0, 256, min(n, _BLOCK), dtype=np.uint8)
        payload = self.buf[codec.HEADER_SIZE : size]
        for off in range(0, n, _BLOCK):
            payload[off : off + _BLOCK] = block[: min(_BLOCK, n - off)]
        codec.encode_into(self.buf, key, codec.ObjectGeometry(1, 1, n), None, parent)
        return memoryview(self.buf)[:size]


def key_fields(key: ObjectKey) -> dict[str, object]:
    return {"namespace": bytes(key.namespace), "chunk_hash": bytes(key.chunk_hash), "tag": key.tag}


def write_tokens(path: Path, entries: Sequence[dict]) -> Path:
    path.write_text(yaml.safe_dump({"tokens": list(entries)}))
    return path


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class StoreClient:
    """Synchronous test client of one store process (see the module docstring)."""

    def __init__(
        self,
        target: str,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, object]] = (),
    ) -> None:
        opts = [*CHANNEL_OPTIONS, *options]
        self.target = target
        self.channel = (
            grpc.secure_channel(target, credentials, options=opts)
            if credentials
            else grpc.insecure_channel(target, options=opts)
        )
        self.stub = pb_grpc.KVStoreStub(self.channel)
        token = token or local_token()  # none given: this user's default token, as real clients do
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.token = token
        self._hello: pb.HelloResponse | None = None
        self.session: ShmSession | None = None

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None
        self.channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, request, timeout: float = 20.0):
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=timeout)

    def hello(self) -> pb.HelloResponse:
        if self._hello is None:
            self._hello = self.call("Hello", pb.HelloRequest())
        return self._hello

    @property
    def tenant(self) -> str:
        return self.hello().tenant

    def scoped(self, key: ObjectKey) -> ObjectKey:
        return ObjectKey(key.namespace.scoped(self.tenant), key.chunk_hash, key.tag)

    def open_session(self) -> ShmSession:
        """A shared-memory session: the tenant's pool, mapped (read-only for a token
        without write)."""
        if self.session is None:
            h = self.hello()
            assert h.shm_socket, "token without shm: no shared memory"
            ticket = self.call("OpenData", pb.OpenDataRequest()).ticket
            self.session = ShmSession.open(h.shm_socket, ticket, self.token)
        return self.session

    @property
    def segment(self) -> np.ndarray:
        """The caller's tenant's pool (same host, token with shm)."""
        return self.open_session().array

    # --- puts ---------------------------------------------------------------------------

    def put_start(
        self, key: ObjectKey, size: int, parent_hash: bytes = b"", session: int | None = None
    ) -> pb.PutStartResponse:
        if session is None:
            session = self.open_session().session_id
        return self.call(
            "PutStart", pb.PutStartRequest(size=size, parent_hash=parent_hash, session=session, **key_fields(key))
        )

    def put_shm(self, key: ObjectKey, obj: memoryview, parent_hash: bytes = b"") -> int:
        """Two-phase put through the segment; the PutOutcome."""
        start = self.put_start(key, len(obj), parent_hash)
        if start.outcome != pb.PUT_OUTCOME_UNSPECIFIED:
            return start.outcome
        self.segment[start.offset : start.offset + len(obj)] = np.frombuffer(obj, np.uint8)
        return self.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id)).outcome

    def put_stream(self, key: ObjectKey, obj: memoryview, frame: int = 1 * MiB, parent_hash: bytes = b"") -> int:
        return self.put_frames(stream_frames(key, obj, frame, parent_hash))

    def put_frames(self, frames: Iterator[pb.PutFrame]) -> int:
        return self.call("PutStream", frames).outcome

    # --- gets ---------------------------------------------------------------------------

    def get_shm(self, key: ObjectKey, out: np.ndarray, lease_ms: int = 0) -> int | None:
        """Copy the object into ``out`` under a lease, check it and rekey it to ``key``;
        its length, or None on a miss (including a lease that expired meanwhile)."""
        reply = self.call("Get", pb.GetRequest(lease_ms=lease_ms, **key_fields(key)))
        if not reply.found:
            return None
        n = reply.length
        out[:n] = self.segment[reply.offset : reply.offset + n]
        valid = self.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[reply.lease_id])).valid
        if not valid[0]:
            return None
        return self._check(key, out, n)

    def get_stream(self, key: ObjectKey, out: np.ndarray) -> int | None:
        total = 0
        for i, frame in enumerate(self.call("GetStream", pb.GetRequest(**key_fields(key)))):
            if i == 0:
                if not frame.found:
                    return None
                total = frame.total_length
            out[frame.offset : frame.offset + len(frame.data)] = np.frombuffer(frame.data, np.uint8)
        return self._check(key, out, total)

    def _check(self, key: ObjectKey, out: np.ndarray, n: int) -> int:
        view = memoryview(out)[:n]
        codec.verify(view, expected_key=self.scoped(key), length=n)
        codec.rekey(view, key, clear_mac=True)
        return n

    # --- the rest -----------------------------------------------------------------------

    def lookup(self, keys: Sequence[ObjectKey]) -> pb.LookupResponse:
        k0 = keys[0]
        return self.call(
            "Lookup",
            pb.LookupRequest(
                namespace=bytes(k0.namespace), tag=k0.tag, chunk_hashes=[bytes(k.chunk_hash) for k in keys]
            ),
        )

    def delete(self, key: ObjectKey) -> bool:
        return self.call("Delete", pb.DeleteRequest(**key_fields(key))).deleted

    def stats(self) -> tuple[dict, dict[str, float]]:
        reply = self.call("Stats", pb.StatsRequest())
        return json.loads(reply.json), dict(reply.counters)


def stream_frames(
    key: ObjectKey, obj: memoryview, frame: int = 1 * MiB, parent_hash: bytes = b"", size: int | None = None
) -> Iterator[pb.PutFrame]:
    """A PutStream: ``start`` (announcing ``size``, default ``len(obj)``), then the bytes."""
    n = len(obj) if size is None else size
    yield pb.PutFrame(start=pb.PutStartRequest(size=n, parent_hash=parent_hash, **key_fields(key)))
    for off in range(0, len(obj), frame):
        yield pb.PutFrame(data=bytes(obj[off : off + frame]))


def rpc_code(fn: Callable[[], object]) -> grpc.StatusCode:
    """The status code ``fn`` fails with (OK when it does not fail)."""
    try:
        fn()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK
