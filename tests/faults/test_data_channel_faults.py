"""The store's raw TCP data channel under bad input and broken connections, against a real
``kvstore serve`` (raw sockets from ``tests.kits.data_channel``): forged, expired, reused and other
tenants' tickets open nothing; refused requests are answered and the connection goes on;
garbage and oversized puts end the connection; a connection cut mid-get or mid-put gives the
object reference or the reservation back on the server, and never stores half an object;
the client sees a cut as an error (a miss in the remote tier), never as wrong bytes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import grpc
import numpy as np
import pytest

from kvstore.client.store_client import StoreClient as AsyncClient
from kvstore.client.tier import RemoteTier
from kvstore.errors import TierUnavailableError
from kvstore.testing.serve_proc import StoreProcess
from kvstore.wire import data as wire
from tests.kits.data_channel import RawData, ticket_of
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, random_key, wait_until
from tiers.base import PutResult

Code = grpc.StatusCode
TOKENS = [
    {"token": "ta", "tenant": "a", "permissions": ["read", "write"]},
    {"token": "ta-read", "tenant": "a", "permissions": ["read"]},
    {"token": "tb", "tenant": "b", "permissions": ["read", "write"]},
    {"token": "tops", "tenant": "ops", "permissions": ["read", "admin"]},
]  # the server's counters


@pytest.fixture(scope="module")
def store(store_process):
    return store_process(
        "--host-capacity", "256MiB", "--data-ticket-ttl", "0.3", "--put-ttl", "5", tokens=TOKENS, name="data-faults"
    )


@pytest.fixture(scope="module")
def objects():
    return Objects(64 * MiB)


def code_of(head: wire.ReplyHead) -> Code:
    return next(c for c in Code if c.value[0] == head.code)


def counters(client: StoreClient) -> dict[str, float]:
    """The whole server's counters (an admin token: a tenant's Stats shows its own only)."""
    with StoreClient(client.target, "tops") as admin:
        return admin.stats()[1]


def no_leaks(client: StoreClient) -> bool:
    c = counters(client)
    return (c["puts_in_flight"], c["host.pending"], c["host.refs_held"], c["leases_held"]) == (0, 0, 0, 0)


# --- tickets ----------------------------------------------------------------------------------


def test_forged_reused_and_expired_tickets_open_nothing(store):
    with StoreClient(store.target, "ta") as a:
        _, port = ticket_of(a)
        refused = counters(a)["data_tickets_refused"]
        with RawData(port) as raw:
            head, message = raw.hello(os.urandom(32), "ta")  # forged
            assert code_of(head) is Code.UNAUTHENTICATED and "ticket" in message
            assert raw.closed_by_server()
        ticket, _ = ticket_of(a)
        with RawData(port) as first:
            assert first.hello(ticket, "ta")[0].code == 0
            with RawData(port) as second:  # reused
                assert code_of(second.hello(ticket, "ta")[0]) is Code.UNAUTHENTICATED
                assert second.closed_by_server()
            assert first.get(random_key(np.random.default_rng(1)))[0].flag == 0  # first still serves
        ticket, _ = ticket_of(a)
        time.sleep(0.4)  # TTL 0.3 s
        with RawData(port) as late:
            assert code_of(late.hello(ticket, "ta")[0]) is Code.UNAUTHENTICATED
        assert counters(a)["data_tickets_refused"] - refused == 3


def test_another_tenants_ticket_is_refused_and_spent(store):
    with StoreClient(store.target, "ta") as a:
        ticket, port = ticket_of(a)
        with RawData(port) as thief:
            head, message = thief.hello(ticket, "tb")
            assert code_of(head) is Code.PERMISSION_DENIED and "another tenant" in message
        with RawData(port) as owner:  # spent by the attempt
            assert code_of(owner.hello(ticket, "ta")[0]) is Code.UNAUTHENTICATED
        for token in (None, "nobody"):
            ticket, _ = ticket_of(a)
            with RawData(port) as anon:
                assert code_of(anon.hello(ticket, token)[0]) is Code.UNAUTHENTICATED


def test_garbage_instead_of_a_hello_is_refused(store):
    with StoreClient(store.target, "ta") as a:
        _, port = ticket_of(a)
    with RawData(port) as raw:
        raw.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
        head, message = raw.reply()
        assert code_of(head) is Code.INVALID_ARGUMENT and "not a kvstore data channel client" in message
        assert raw.closed_by_server()


# --- requests ---------------------------------------------------------------------------------


def test_refused_requests_are_answered_and_the_connection_goes_on(store, objects):
    rng = np.random.default_rng(2)
    key = random_key(rng)
    with StoreClient(store.target, "ta-read") as reader, StoreClient(store.target, "ta") as writer:
        ticket, port = ticket_of(reader)
        with RawData(port) as raw:
            assert raw.hello(ticket, "ta-read")[0].code == 0
            head, message = raw.put(key, objects.make(key, 64 * KiB))  # no write permission
            assert code_of(head) is Code.PERMISSION_DENIED and "write" in message
            bad = bytes(key)[:64] + b"no spaces"
            head, _, _ = raw.get(bad)  # an invalid tag
            assert code_of(head) is Code.INVALID_ARGUMENT
            head, _, _ = raw.get(bytes(key)[:40])  # a short key
            assert code_of(head) is Code.INVALID_ARGUMENT
            assert raw.get(key)[0].flag == 0  # still serving: a miss
        ticket, port = ticket_of(writer)
        with RawData(port) as raw:
            assert raw.hello(ticket, "ta")[0].code == 0
            obj = bytearray(objects.make(key, 2 * MiB))
            obj[-1] ^= 0xFF  # checksum no longer matches
            assert code_of(raw.put(key, obj)[0]) is Code.FAILED_PRECONDITION
            obj[-1] ^= 0xFF
            head, _ = raw.put(key, obj)
            assert (head.code, head.flag) == (0, 1)  # PUT_OUTCOME_STORED
            assert raw.put(key, obj)[0].flag == 2  # EXISTS (bytes drained)
            head, _, body = raw.get(key)
            assert (head.code, head.flag, head.length) == (0, 1, 2 * MiB) and len(body) == 2 * MiB
            head, _ = raw.put(key, b"x" * 10, size=10)  # below a header's size
            assert code_of(head) is Code.INVALID_ARGUMENT
            assert writer.delete(key)
        assert wait_until(lambda: no_leaks(writer))


def test_a_put_above_max_object_bytes_ends_the_connection(store):
    with StoreClient(store.target, "ta") as a:
        ticket, port = ticket_of(a)
        limit = a.hello().max_object_bytes
        with RawData(port) as raw:
            assert raw.hello(ticket, "ta")[0].code == 0
            raw.sock.sendall(wire.encode_request(wire.Op.PUT, random_key(np.random.default_rng(3)), limit + 1))
            head, message = raw.reply()  # answered at once
            assert code_of(head) is Code.RESOURCE_EXHAUSTED and "max_object_bytes" in message
            assert raw.closed_by_server()
        assert wait_until(lambda: no_leaks(a))


# --- connections cut mid-transfer ---------------------------------------------------------------


def test_a_put_cut_mid_object_stores_nothing_and_frees_its_reservation(store, objects):
    key = random_key(np.random.default_rng(4))
    size = 32 * MiB
    obj = objects.make(key, size)
    with StoreClient(store.target, "ta") as a:
        ticket, port = ticket_of(a)
        raw = RawData(port)
        assert raw.hello(ticket, "ta")[0].code == 0
        raw.sock.sendall(wire.encode_request(wire.Op.PUT, key, size))
        raw.sock.sendall(obj[: size // 2])
        assert wait_until(lambda: counters(a)["host.pending"] == 1)  # reserved, being filled
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()  # a reset mid-object
        assert wait_until(lambda: no_leaks(a))
        assert a.lookup([key]).hits == 0
        assert counters(a)["store.puts.tcp.failed"] >= 1


def test_a_get_cut_mid_object_releases_its_reference(store, objects):
    key = random_key(np.random.default_rng(5))
    size = 48 * MiB
    with StoreClient(store.target, "ta") as a:
        ticket, port = ticket_of(a)
        with RawData(port) as writer:
            assert writer.hello(ticket, "ta")[0].code == 0
            assert writer.put(key, objects.make(key, size))[0].flag == 1
        ticket, _ = ticket_of(a)
        raw = RawData(port)
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        assert raw.hello(ticket, "ta")[0].code == 0
        raw.sock.sendall(wire.encode_request(wire.Op.GET, key))
        head, _ = raw.reply()
        assert (head.flag, head.length) == (1, size)
        raw.recv(1 * MiB)  # then stop reading
        assert counters(a)["host.refs_held"] == 1  # the server is mid-send
        raw.close()
        assert wait_until(lambda: no_leaks(a))
        assert a.delete(key)


async def test_client_sees_a_server_killed_mid_get_as_an_error_and_the_tier_as_a_miss(tmp_path, objects):
    proc = StoreProcess(tmp_path, "--host-capacity", "600MiB", "--max-object-bytes", "512MiB").start()
    key = random_key(np.random.default_rng(6))
    size = 256 * MiB
    out = np.full(size, 0xA5, np.uint8)
    try:
        tier = await RemoteTier.open(proc.target, transport="tcp", timeout_s=30)
        assert tier.client.uses_tcp
        assert await tier.put(key, objects_of(key, size)) is PutResult.STORED
        task = asyncio.create_task(tier.read_into(key, memoryview(out)))
        for _ in range(200_000):  # the first bytes landed
            if (out[:4096] != 0xA5).any():
                break
            assert not task.done(), "the read ended before its first bytes arrived"
            await asyncio.sleep(0)
        os.kill(proc.pid, signal.SIGSTOP)
        assert not task.done()
        proc.kill()
        assert await task is None  # a miss, not an exception
        s = tier.stats()
        assert (s.hits, s.misses, s.corrupt, s.extra["breaker_open"]) == (0, 1, 0, 1.0)
        with pytest.raises(TierUnavailableError):
            await tier.client.read_into(key, memoryview(out))
        await tier.aclose()
    finally:
        proc.kill()


async def test_a_cancelled_get_never_writes_the_buffer_afterwards(tmp_path):
    # The stream deadline of a 128 MiB object is 2 + 128/32 = 6 s here: the server gives the
    # cut get's reference back when it sees the connection go, or by then at the latest.
    proc = StoreProcess(
        tmp_path, "--host-capacity", "300MiB", "--stream-grace", "2", "--stream-min-rate", "32MiB"
    ).start()
    key = random_key(np.random.default_rng(7))
    size = 128 * MiB
    out = np.full(size, 0xA5, np.uint8)
    try:
        async with (
            await AsyncClient.connect(proc.target, transport="tcp", timeout_s=30) as client,
            await AsyncClient.connect(proc.target, transport="stream") as watcher,
        ):
            assert await client.put(key, objects_of(key, size)) is PutResult.STORED
            task = asyncio.create_task(client.read_into(key, memoryview(out)))
            while not (out[:4096] != 0xA5).any():
                assert not task.done()
                await asyncio.sleep(0)
            os.kill(proc.pid, signal.SIGSTOP)  # mid-object
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            snapshot = out.copy()
            os.kill(proc.pid, signal.SIGCONT)  # the server would send more
            await asyncio.sleep(0.3)
            assert np.array_equal(out, snapshot)  # nothing landed after
            assert client.uses_tcp and await client.read_into(key, memoryview(out)) == size  # a new connection
            async with asyncio.timeout(12):  # twice that deadline: a reference never given back fails
                while (await watcher.stats())["server_counters"]["host.refs_held"] != 0:
                    await asyncio.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.terminate(30) == 0


def objects_of(key, size: int) -> np.ndarray:
    return np.frombuffer(Objects(size).make(key, size, seed=size % 251), np.uint8)
