"""Lease requests on the shared-memory session's socket, against a real ``kvstore serve``
(``kvstore.server.shmreads``, ``kvstore.client.shmleases``): the same answers as ``Get``
(places, misses, scoping, quotas, permissions), pipelined and answered by id; a request the
format does not allow ends the session; a lease answered to a reader that gave up is
released, not leaked.  And a pool only the store writes (sealed: its tenant's writers have
no ``shm``) is read without checksumming the copy again, while a pool a writer maps still
is.  The raw tests speak the format by hand on a real session.
Cost: one store process for the module, about 5 s in all."""

from __future__ import annotations

import asyncio
import dataclasses
import mmap
import socket

import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.bench.store import make_object
from kvstore.client.store_client import StoreClient as AsyncClient
from kvstore.keys import ObjectKey
from kvstore.wire import shm as shmwire
from tests.kits.data_channel import ticket_of
from tests.kits.hostile import QUOTAS, TOKENS, admin_counters, keys, start_store
from tests.kits.store_calls import MiB, Objects, StoreClient
from tiers.base import PutResult

RESOURCE_EXHAUSTED = 8
SEALED = [  # tenant s: its writer puts over the network, its reader maps the pool
    {"token": "tok-s", "tenant": "s", "permissions": ["read", "write"]},
    {"token": "tok-s-ro", "tenant": "s", "permissions": ["read", "shm"]},
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    quotas = {**QUOTAS, "s": {"host_bytes": "4MiB"}}
    proc = start_store(tmp_path_factory.mktemp("shm-leases"), quotas=quotas, tokens=TOKENS + SEALED)
    yield proc
    assert proc.terminate(30) == 0


class RawSession:
    """A gate session opened by hand, kept open for lease requests."""

    def __init__(self, client: StoreClient) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(client.hello().shm_socket)
        self.sock.sendall(shmwire.encode_hello(ticket_of(client)[0], client.token))
        data, fds, _, _ = socket.recv_fds(self.sock, 4096, 1)
        self.reply = shmwire.decode_reply(data[: shmwire.REPLY.size])
        assert self.reply.code == 0 and len(fds) == 1
        self.pool = np.frombuffer(mmap.mmap(fds[0], self.reply.pool_size, prot=mmap.PROT_READ), np.uint8)
        socket.close(fds[0])

    def ask(self, key: ObjectKey, request: int, lease_ms: int = 0) -> None:
        self.sock.sendall(shmwire.encode_lease(bytes(key), lease_ms, request))

    def answer(self) -> shmwire.Leased:
        head, message_len = shmwire.decode_leased_head(self._exactly(shmwire.LEASED.size))
        message = self._exactly(message_len).decode() if message_len else ""
        return dataclasses.replace(head, message=message)

    def _exactly(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            assert chunk, "the store closed the session"
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def test_pipelined_lease_requests_answer_what_get_answers(store):
    objects = Objects(1 * MiB)
    present, absent = keys(2, seed=41)
    with StoreClient(store.target, "tok-a") as a, StoreClient(store.target, "tok-b") as b:
        obj = bytes(objects.make(present, 1 * MiB, seed=3))
        assert a.put_shm(present, memoryview(obj)) == pb.PUT_OUTCOME_STORED
        raw, other = RawSession(a), RawSession(b)
        try:
            assert raw.reply.serves_leases
            for request, key in ((7, present), (9, absent), (11, present)):  # all sent before any answer
                raw.ask(key, request, lease_ms=3000)
            answers = {ans.request: ans for ans in (raw.answer(), raw.answer(), raw.answer())}
            assert set(answers) == {7, 9, 11}
            assert answers[9] == shmwire.Leased(9)  # a miss: no error, no lease
            for request in (7, 11):
                got = answers[request]
                assert got.code == 0 and got.found and got.length == len(obj) and got.lease_ms == 3000
                copy = raw.pool[got.offset : got.offset + got.length].tobytes()
                assert copy[256:] == obj[256:]  # the payload, under a's scoped key
            assert answers[7].lease_id != answers[11].lease_id
            # the leases are real: gRPC releases them as it would Get's
            released = a.call(
                "ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[answers[7].lease_id, answers[11].lease_id])
            )
            assert list(released.valid) == [True, True]
            other.ask(present, 1)  # b's session asks for a's key: scoped to b, not there
            assert other.answer() == shmwire.Leased(1)
        finally:
            raw.close()
            other.close()


def test_the_tenants_lease_quota_answers_resource_exhausted(store):
    key = keys(1, seed=42)[0]
    with StoreClient(store.target, "tok-b") as b:
        assert b.put_shm(key, memoryview(Objects(MiB // 4).make(key, MiB // 4, seed=5))) == pb.PUT_OUTCOME_STORED
        raw = RawSession(b)
        try:
            for request in range(1, 6):  # b may hold 4 leases
                raw.ask(key, request, lease_ms=5000)
            answers = sorted((raw.answer() for _ in range(5)), key=lambda ans: ans.request)
            assert [ans.found for ans in answers].count(True) == 4
            (refused,) = [ans for ans in answers if not ans.found]
            assert refused.code == RESOURCE_EXHAUSTED and "leases" in refused.message
            ids = [ans.lease_id for ans in answers if ans.found]
            b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=ids))
            raw.ask(key, 6)  # released: a lease is granted again
            assert raw.answer().found
        finally:
            raw.close()


def test_a_request_the_format_does_not_allow_ends_the_session(store):
    with StoreClient(store.target, "tok-a") as a:
        before = admin_counters(store.target).get("store.failures.shm_request", 0)
        raw = RawSession(a)
        try:
            raw.sock.sendall(shmwire.LEASE.pack(ord("X"), 66, 0, 0, 1))  # op "X": no such request
            assert raw.sock.recv(1) == b""  # closed by the store, nothing answered
        finally:
            raw.close()
        assert admin_counters(store.target).get("store.failures.shm_request", 0) == before + 1


def test_a_lease_answered_after_its_reader_gave_up_is_released(store):
    async def run() -> None:
        key, obj = make_object(64 * 1024, 17)  # read inline: no copy thread
        client = await AsyncClient.connect(store.target, token="tok-a", transport="shm", timeout_s=10)
        try:
            assert await client.put(key, obj) is not None
            line = client.planes.session.leases
            assert line is not None
            out = np.empty(len(obj), np.uint8)
            assert await client.read_into(key, memoryview(out)) == len(obj)  # the line is open
            task = asyncio.get_running_loop().create_task(line.lease(bytes(key), 0, 10))
            await asyncio.sleep(0)  # the request is written
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):  # its answer arrives to nobody
                if line.orphans:
                    break
                await asyncio.sleep(0.01)
            (orphan,) = line.orphans
            calls = client.counters.release_calls
            assert await client.read_into(key, memoryview(out)) == len(obj)  # takes the orphan along
            assert not line.orphans
            await client.flush_releases()
            assert client.counters.release_calls > calls
            granted = await client.reader.renew(orphan, 1000)
            assert granted is None  # the server no longer holds it
            assert out[256:].tobytes() == obj[256:].tobytes()
            # an orphan left when the client stops reading goes with its last flush
            task = asyncio.get_running_loop().create_task(line.lease(bytes(key), 0, 10))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(500):
                if line.orphans:
                    break
                await asyncio.sleep(0.01)
            (last,) = line.orphans
            await client.flush_releases()  # what close does first
            assert not line.orphans and await client.reader.renew(last, 1000) is None
        finally:
            await client.close()

    asyncio.run(run())


def test_a_pool_only_the_store_writes_is_read_without_a_second_checksum(store):
    async def run() -> None:
        clients = [
            await AsyncClient.connect(store.target, token=token, transport=transport, timeout_s=10)
            for token, transport in (("tok-s", "auto"), ("tok-s-ro", "shm"), ("tok-a", "shm"), ("tok-a-ro", "shm"))
        ]
        s_writer, s_reader, a_writer, a_reader = clients
        try:
            assert not s_writer.uses_shm  # no shm: it puts over TCP
            assert s_reader.planes.session.sealed and not a_reader.planes.session.sealed
            for writer, reader, seed in ((s_writer, s_reader, 23), (a_writer, a_reader, 24)):
                key, obj = make_object(2 * MiB, seed)  # above the inline size: the copy thread's
                assert await writer.put(key, obj) is PutResult.STORED
                copier, hashed = reader.reader._copier, []
                copy_digest = copier.copy_digest
                copier.copy_digest = lambda dst, src, f=copy_digest: hashed.append(len(src)) or f(dst, src)
                out = np.empty(len(obj), np.uint8)
                assert await reader.read_into(key, memoryview(out)) == len(obj)
                assert out[256:].tobytes() == obj[256:].tobytes()
                assert hashed == ([] if reader is s_reader else [len(obj)])  # a pool a writer maps: hashed
        finally:
            for client in clients:
                await client.close()

    asyncio.run(run())
