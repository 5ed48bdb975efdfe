"""Client processes of the tenant load test (``tests/integration/test_tenant_load.py``): each
function is the body of one spawned process against a real ``kvstore serve``, and returns
its counters (a dict) through a queue.

* ``good``: a well-behaved client of tenant ``good`` (the real ``StoreClient``, over shared
  memory, the data channel or gRPC streams): puts its own objects, reads them back and
  checks every byte against what it wrote, puts and deletes fresh objects, and connects
  anew every ``RECONNECT_S``; it counts its steps, those served right, and its read p99.
* ``flooder`` and ``forger`` (tenant ``evil1``): floods puts, hoards leases and
  reservations; malformed requests, bad frames, garbage on the data channel, forged
  tickets and forged objects claiming good's keys, reads and deletes of good's keys.
* ``staller`` and ``scribbler`` (tenant ``evil2``): slow and stalled streams on gRPC and the
  data channel; scribbles over its own pool, writes late into expired reservations,
  churns sessions beyond its quota.

Hostile attempts count what they tried and how the server answered (``code:NAME``); hostile
processes run at nice 19 (on 2 cores: the server is measured, not CPU contention).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections import Counter

import grpc
import numpy as np

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import ObjectFormatError
from kvstore.keys import ChunkHash, Namespace, ObjectKey
from kvstore.wire import data as wire
from kvstore.wire import shm as shmwire
from tests.kits.data_channel import RawData, ticket_of
from tests.kits.store_calls import MiB, StoreClient, key_fields, rpc_code

GOOD_OBJECTS, GOOD_SIZE = 6, 1 * MiB
RECONNECT_S = 2.0  # a good client connects anew this often (it meets the connection attacks)
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0)]


def good_key(worker: int, j: int) -> ObjectKey:
    rng = np.random.default_rng([7, worker, j])
    return ObjectKey(Namespace(np.random.default_rng([7, worker]).bytes(32)), ChunkHash(rng.bytes(32)), "r0")


def good_object(key: ObjectKey, size: int = GOOD_SIZE) -> np.ndarray:
    payload = np.random.default_rng(list(key[32:40])).integers(0, 256, size - codec.HEADER_SIZE, dtype=np.uint8)
    buf = np.empty(size, np.uint8)
    codec.encode_into(buf, key, codec.ObjectGeometry(1, 1, size - codec.HEADER_SIZE), payload)
    return buf


def _code(err: BaseException) -> str:
    return f"code:{err.code().name}" if isinstance(err, grpc.RpcError) else f"error:{type(err).__name__}"


def run(name: str, target: str, token: str, seconds: float, out, arg: str = "") -> None:
    """Process entry: run worker ``name`` for ``seconds`` and put its counters in ``out``."""
    deadline = time.monotonic() + seconds
    counts: Counter = Counter()
    if name != "good":
        os.nice(19)  # on 2 cores: measure the server, not CPU contention
    try:
        if name == "good":
            asyncio.run(_good(target, token, deadline, counts, arg))
        else:
            globals()[name](target, token, deadline, counts)
    except BaseException as err:  # noqa: BLE001 - reported, the parent fails the test
        counts[f"crashed:{type(err).__name__}:{err}"] += 1
    out.put((name, arg, dict(counts)))


# --- the well-behaved tenant -----------------------------------------------------------


async def _good(target: str, token: str, deadline: float, counts: Counter, arg: str) -> None:
    """Puts its objects, then reads them back (timed, every byte checked); every 8th step
    also puts a fresh 64 KiB object (written through to the SSD tier) and deletes the one
    before; every ``RECONNECT_S`` s it connects anew (hello, session or data connection).
    Each step counts as ``ops`` and, served right, ``ok``; the read p99 goes in ``p99_us``."""
    transport, worker = arg.split(":")
    keys = [good_key(int(worker), j) for j in range(GOOD_OBJECTS)]
    want = {k: good_object(k) for k in keys}
    lat: list[float] = []
    c = await _connect(target, token, transport, counts)
    for k in keys:
        counts[f"put:{(await c.put(k, want[k])).value}"] += 1
    step, since, fresh = 0, time.monotonic(), []
    while time.monotonic() < deadline:
        step += 1
        if time.monotonic() - since > RECONNECT_S:
            await c.close()
            c, since = await _connect(target, token, transport, counts), time.monotonic()
        try:
            ok = await (_churn_one(c, int(worker), step, fresh) if step % 8 == 0 else _read_one(c, keys, want, lat))
        except Exception as err:  # noqa: BLE001 - a refusal of good: counted, the test fails on it
            counts[f"failed:{type(err).__name__}:{err}"[:160]] += 1
            ok = False
        counts["ops"] += 1
        counts["ok"] += ok
    for k in keys + fresh:
        await c.delete(k)
    await c.close()
    counts["reads_timed"], counts["p99_us"] = len(lat), int(np.percentile(lat, 99) * 1e6) if lat else 0


async def _connect(target: str, token: str, transport: str, counts: Counter):
    """A new client of ``transport``; a refused connect counts as a failed step and is retried."""
    from kvstore.client.store_client import StoreClient as Client

    while True:
        counts["ops"] += 1
        try:
            c = await Client.connect(target, token=token, transport=transport, timeout_s=10)
        except Exception as err:  # noqa: BLE001 - counted, the test fails on it
            counts[f"failed:connect:{type(err).__name__}:{err}"[:160]] += 1
            await asyncio.sleep(0.1)
            continue
        counts["ok"] += 1
        counts[f"transport:{'shm' if c.uses_shm else 'tcp' if c.uses_tcp else 'stream'}"] += 1
        return c


async def _read_one(c, keys: list[ObjectKey], want: dict, lat: list[float]) -> bool:
    k = keys[int(time.monotonic_ns()) % len(keys)]
    buf = np.zeros(GOOD_SIZE, np.uint8)
    t0 = time.perf_counter()
    n = await c.read_into(k, memoryview(buf))
    lat.append(time.perf_counter() - t0)
    return n == GOOD_SIZE and bool(np.array_equal(buf, want[k]))


async def _churn_one(c, worker: int, step: int, fresh: list[ObjectKey]) -> bool:
    key = good_key(1000 + worker, step)
    stored = (await c.put(key, good_object(key, 64 * 1024))).value == "stored"
    fresh.append(key)
    deleted = await c.delete(fresh.pop(0)) if len(fresh) > 2 else True
    return stored and deleted


# --- evil1: floods and stalls ---------------------------------------------------------------


def flooder(target: str, token: str, deadline: float, counts: Counter) -> None:
    rng = np.random.default_rng(11)
    stored: list[ObjectKey] = []
    with StoreClient(target, token) as c:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            key = ObjectKey(Namespace(rng.bytes(32)), ChunkHash(rng.bytes(32)), "r0")
            obj = good_object(key, 2 * MiB)
            try:
                outcome = c.put_shm(key, memoryview(obj)) if i % 2 else c.put_stream(key, memoryview(obj))
                counts[f"flood_put:{pb.PutOutcome.Name(outcome)}"] += 1
                if outcome == pb.PUT_OUTCOME_STORED:
                    stored.append(key)
            except grpc.RpcError as err:
                counts[f"flood_put:{_code(err)}"] += 1
            for held in stored[-3:]:  # hoard leases: never released
                try:
                    found = c.call("Get", pb.GetRequest(lease_ms=3_000, **key_fields(held))).found
                    counts["lease_hoard:" + ("granted" if found else "miss")] += 1
                except grpc.RpcError as err:
                    counts[f"lease_hoard:{_code(err)}"] += 1
            if i % 3 == 0:  # hoard reservations: never committed
                try:
                    c.put_start(ObjectKey(key.namespace, ChunkHash(rng.bytes(32)), "r0"), 1 * MiB)
                    counts["reservation_hoard:granted"] += 1
                except grpc.RpcError as err:
                    counts[f"reservation_hoard:{_code(err)}"] += 1
            if i % 5 == 0:  # good's keys, as evil1 (it knows the hashes)
                counts["cross_read:" + ("hit" if c.lookup([good_key(0, 0)]).hits else "miss")] += 1


def staller(target: str, token: str, deadline: float, counts: Counter) -> None:
    rng = np.random.default_rng(12)
    with StoreClient(target, token) as c, StoreClient(target, token, options=SLOW_READER) as slow:
        big = ObjectKey(Namespace(rng.bytes(32)), ChunkHash(rng.bytes(32)), "r0")
        obj = good_object(big, 12 * MiB)
        while time.monotonic() < deadline:
            try:  # (again: the scribbler shares this tenant's pool)
                c.put_stream(big, memoryview(obj))
            except grpc.RpcError as err:  # scribbled mid-put: the server refused it
                counts[f"big_put:{_code(err)}"] += 1
            threads = [
                threading.Thread(target=fn, args=(c, slow, big, counts), daemon=True)
                for fn in (_slow_put, _stalled_get, _slow_data_put, _slow_put)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)


def _slow_put(c: StoreClient, _slow, big: ObjectKey, counts: Counter) -> None:
    key = ObjectKey(big.namespace, ChunkHash(os.urandom(32)), "r0")

    def frames():
        yield pb.PutFrame(start=pb.PutStartRequest(size=8 * MiB, **key_fields(key)))
        yield pb.PutFrame(data=bytes(MiB))
        time.sleep(20)  # silence: the deadline cuts it

    counts[f"slow_put_stream:code:{rpc_code(lambda: c.put_frames(frames())).name}"] += 1


def _stalled_get(_c, slow: StoreClient, big: ObjectKey, counts: Counter) -> None:
    def read_one_then_stall():
        frames = slow.call("GetStream", pb.GetRequest(**key_fields(big)), timeout=30)
        if not next(frames).found:
            raise LookupError
        time.sleep(3)  # reads nothing: past its deadline
        list(frames)

    try:
        counts[f"stalled_get_stream:code:{rpc_code(read_one_then_stall).name}"] += 1
    except LookupError:
        counts["stalled_get_stream:miss"] += 1


def _slow_data_put(c: StoreClient, _slow, big: ObjectKey, counts: Counter) -> None:
    try:
        ticket, port = ticket_of(c)
        with RawData(port) as raw:
            if raw.hello(ticket, c.token)[0].code:
                counts["slow_data_put:refused"] += 1
                return
            raw.sock.sendall(wire.encode_request(wire.Op.PUT, big, 8 * MiB))
            raw.sock.sendall(bytes(MiB))
            raw.sock.settimeout(20)
            counts["slow_data_put:" + ("cut" if raw.closed_by_server() else "answered")] += 1
    except (OSError, grpc.RpcError) as err:
        counts[f"slow_data_put:{_code(err)}"] += 1


# --- evil2: bad input, forgeries, scribbling ----------------------------------------------------


def forger(target: str, token: str, deadline: float, counts: Counter) -> None:
    rng = np.random.default_rng(13)
    channel = grpc.insecure_channel(target)
    with StoreClient(target, token) as c:
        while time.monotonic() < deadline:
            method = ["Get", "PutStart", "Lookup", "Delete"][rng.integers(4)]
            call = channel.unary_unary(f"/kvstore.v1.KVStore/{method}")
            raw = bytes([3 << 3 | 2, 3]) + b"\xff\xfe\xfd"  # a tag that is not UTF-8
            counts[f"malformed_grpc:code:{rpc_code(lambda: call(raw, timeout=10, metadata=c.metadata)).name}"] += 1
            key = good_key(0, int(rng.integers(GOOD_OBJECTS)))
            bad = iter([pb.PutFrame(data=b"x" * 100)])  # data before start
            counts[f"bad_put_frames:code:{rpc_code(lambda: c.put_frames(bad)).name}"] += 1
            forged = good_object(ObjectKey(key.namespace.scoped("good"), key.chunk_hash, key.tag), 64 * 1024)
            try:
                counts[f"forged_object:{pb.PutOutcome.Name(c.put_stream(key, memoryview(forged)))}"] += 1
            except grpc.RpcError as err:  # FAILED_PRECONDITION: not its key
                counts[f"forged_object:{_code(err)}"] += 1
            counts["cross_delete:" + ("deleted" if c.delete(key) else "nothing")] += 1
            counts["cross_read:" + ("hit" if c.lookup([key]).hits else "miss")] += 1
            counts[f"forged_ticket:{_gate(c, os.urandom(32))}"] += 1
            counts[f"data_garbage:{_garbage(c, rng)}"] += 1


def _gate(c: StoreClient, ticket: bytes) -> str:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        try:
            sock.connect(c.hello().shm_socket)
        except BlockingIOError:  # the gate's backlog, full of strangers' connections
            return "gate_backlog_full"
        sock.sendall(shmwire.encode_hello(ticket, c.token))
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        for fd in fds:
            os.close(fd)
        return "code:" + grpc.StatusCode(next(s for s in grpc.StatusCode if s.value[0] == data[0])).name
    finally:
        sock.close()


def _garbage(c: StoreClient, rng: np.random.Generator) -> str:
    ticket, port = ticket_of(c)
    with RawData(port) as raw:
        if raw.hello(ticket, c.token)[0].code:
            return "refused"
        raw.sock.sendall(bytes([0x58]) + rng.bytes(63))  # op "X": not a request
        raw.sock.settimeout(10)
        head, _ = raw.reply()
        code = next(s for s in grpc.StatusCode if s.value[0] == head.code).name
        return f"code:{code}, " + ("closed" if raw.closed_by_server() else "open")


def _churn(target: str, token: str, counts: Counter) -> None:
    """Open 10 sessions at once (the quota is 8), then close them all."""
    clients = [StoreClient(target, token) for _ in range(10)]
    try:
        for c in clients:
            try:
                c.open_session()
                counts["session:opened"] += 1
            except Exception as err:  # noqa: BLE001 - the gate refused: its connection quota
                counts[f"session:refused:{type(err).__name__}"] += 1
    finally:
        for c in clients:
            c.close()


def scribbler(target: str, token: str, deadline: float, counts: Counter) -> None:
    rng = np.random.default_rng(14)
    while time.monotonic() < deadline:
        _churn(target, token, counts)
        with StoreClient(target, token) as c:
            try:
                pool = c.segment
            except Exception:  # noqa: BLE001 - refused while the forger holds connections
                continue
            key = ObjectKey(Namespace(rng.bytes(32)), ChunkHash(rng.bytes(32)), "r0")
            counts[f"own_put:{pb.PutOutcome.Name(c.put_shm(key, memoryview(good_object(key, MiB))))}"] += 1
            try:
                start = c.put_start(ObjectKey(key.namespace, ChunkHash(rng.bytes(32)), "r0"), MiB)
                time.sleep(1.2)  # past put_ttl: fenced
                pool[start.offset : start.offset + MiB] = 0x5A  # the late copy
                counts["late_write:done"] += 1
            except grpc.RpcError as err:
                counts[f"late_write:{_code(err)}"] += 1
            for _ in range(20):  # scribble its whole pool
                at = int(rng.integers(0, len(pool) - 4096))
                pool[at : at + 4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
                counts["scribbled_bytes"] += 4096
            try:
                counts["own_read:" + ("ok" if c.get_stream(key, np.empty(MiB, np.uint8)) else "miss")] += 1
            except ObjectFormatError:  # its own scribbles, caught by the checksum
                counts["own_read:corrupt_detected"] += 1


__all__ = ["GOOD_OBJECTS", "GOOD_SIZE", "flooder", "forger", "good_key", "good_object", "run", "scribbler", "staller"]
