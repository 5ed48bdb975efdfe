"""Hostile tenants against the shared-memory data plane of a real ``kvstore serve`` (issue 12,
attacks 1, 3 and 4): tenant b cannot find, read or change a byte of tenant a's objects
through any mapping it can obtain, nor forge an object a is served; no process reaches a
pool by name; a failed put evicts nothing; a late writer cannot touch a reused slot."""

from __future__ import annotations

import mmap
import os
import socket

import grpc
import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import ObjectKey
from kvstore.wire import shm as shmwire
from tests.kits.data_channel import RawData, ticket_of
from tests.kits.hostile import admin_counters, admin_doc, fd_links, get_request, keys, quiet, start_store
from tests.kits.second_uid import run_as
from tests.kits.store_calls import MiB, Objects, StoreClient, rpc_code, wait_until

Code = grpc.StatusCode


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = start_store(tmp_path_factory.mktemp("hostile-shm"))
    yield proc
    assert proc.terminate(30) == 0


@pytest.fixture
def fresh(tmp_path):
    """A store of its own (tests that need to know exactly what a's pool holds)."""
    proc = start_store(tmp_path)
    yield proc
    assert proc.terminate(30) == 0


def scoped(key: ObjectKey, tenant: str) -> ObjectKey:
    return ObjectKey(key.namespace.scoped(tenant), key.chunk_hash, key.tag)


def test_b_cannot_find_read_or_change_a_byte_of_as_objects(store):
    objects = Objects(2 * MiB)
    mine = keys(3, seed=1)
    with StoreClient(store.target, "tok-a") as a, StoreClient(store.target, "tok-b") as b:
        want = {}
        for i, key in enumerate(mine):
            want[key] = bytes(objects.make(key, 2 * MiB, seed=100 + i))
            assert a.put_shm(key, memoryview(want[key])) == pb.PUT_OUTCOME_STORED
        pool = b.segment  # everything b can map
        assert b.hello().segment_size == len(pool) == 16 * MiB and b.hello().tenant == "b"
        haystack = pool.tobytes()
        for key, obj in want.items():
            assert obj[256:512] not in haystack and bytes(scoped(key, "a")) not in haystack
        pool[:] = np.random.default_rng(5).integers(0, 256, len(pool), dtype=np.uint8)  # scribble it all
        out = np.empty(2 * MiB, np.uint8)
        _, port = ticket_of(a)
        with RawData(port) as raw:
            assert raw.hello(ticket_of(a)[0], "tok-a")[0].code == 0
            for key, obj in want.items():
                assert a.get_shm(key, out) == len(obj) and out.tobytes() == obj
                assert a.get_stream(key, out) == len(obj) and out.tobytes() == obj
                head, _, body = raw.get(key)
                assert head.code == 0 and head.flag and body[256:] == obj[256:]
        for key in mine:  # b cannot even see them
            assert b.lookup([key]).hits == 0 and b.get_shm(key, out) is None


def test_read_only_tokens_map_read_only_and_a_pool_without_writers_is_sealed(store):
    with StoreClient(store.target, "tok-a-ro") as ro:
        assert not ro.segment.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            ro.segment[0] = 1
    for token, sealed in (("tok-a-ro", False), ("tok-c-ro", True)):
        with StoreClient(store.target, token) as c:
            fd, size = raw_session(c)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(fd, size)  # the descriptor is read-only
                reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the same file, read-write
                try:
                    if sealed:  # c has no writer: sealed
                        with pytest.raises(PermissionError):
                            mmap.mmap(reopened, size)
                finally:
                    os.close(reopened)
            finally:
                os.close(fd)


def raw_session(client: StoreClient) -> tuple[int, int]:
    """Open a gate session by hand; (the descriptor received, the pool size)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(client.hello().shm_socket)
    sock.sendall(shmwire.encode_hello(ticket_of(client)[0], client.token))
    data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
    reply = shmwire.decode_reply(data[: shmwire.REPLY.size])
    assert reply.code == 0 and len(fds) == 1 and not reply.writable
    sock.close()
    return fds[0], reply.pool_size


def test_a_forged_object_is_never_served_to_a(store):
    """b seals objects that claim a's (scoped) key, with valid checksums, every way it can:
    through its pool, a stream, the data channel, and by rewriting a published object of
    its own in place.  a never sees one; the server refuses or hides each."""
    target_key = keys(1, seed=2)[0]
    objects = Objects(1 * MiB)
    with StoreClient(store.target, "tok-a") as a, StoreClient(store.target, "tok-b") as b:
        forged = objects.make(scoped(target_key, "a"), 1 * MiB, seed=66)
        start = b.put_start(target_key, len(forged))
        b.segment[start.offset : start.offset + len(forged)] = np.frombuffer(forged, np.uint8)
        assert (
            rpc_code(lambda: b.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id))) == Code.FAILED_PRECONDITION
        )
        assert rpc_code(lambda: b.put_stream(target_key, forged)) == Code.FAILED_PRECONDITION
        _, port = ticket_of(b)
        with RawData(port) as raw:
            assert raw.hello(ticket_of(b)[0], "tok-b")[0].code == 0
            assert raw.put(target_key, forged)[0].code == Code.FAILED_PRECONDITION.value[0]
        own = keys(1, seed=3)[0]  # a published object of b's, rewritten
        assert b.put_shm(own, objects.make(own, 1 * MiB, seed=67)) == pb.PUT_OUTCOME_STORED
        got = b.call("Get", get_request(own))
        b.segment[got.offset : got.offset + got.length] = np.frombuffer(
            objects.make(scoped(target_key, "a"), 1 * MiB, seed=68), np.uint8
        )
        b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[got.lease_id]))
        assert wait_until(lambda: admin_counters(store.target)["write_throughs_in_flight"] == 0)
        out = np.empty(1 * MiB, np.uint8)
        assert a.lookup([target_key]).hits == 0
        assert a.get_shm(target_key, out) is None and a.get_stream(target_key, out) is None
    assert store.restart().running  # and not after a rebuild either
    with StoreClient(store.target, "tok-a") as a:
        assert a.lookup([target_key]).hits == 0 and a.get_stream(target_key, out) is None


def test_no_process_reaches_a_pool_by_name_or_through_proc(store):
    doc = admin_doc(store.target)
    assert doc["server"]["dumpable"] is False  # no ptrace, no /proc/<pid>/fd for its uid
    assert not [p for p in os.listdir("/dev/shm") if str(store.pid) in p]
    links = fd_links(store.pid)
    memfds = [link for link in links if link.startswith("/memfd:kvstore-")]
    assert len(memfds) >= 2 and not [link for link in links if link.startswith("/dev/shm")]
    with StoreClient(store.target, "tok-a") as a, StoreClient(store.target, "tok-b"):
        path = a.hello().shm_socket
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert gate_code(path, os.urandom(32), "tok-a") == Code.UNAUTHENTICATED.value[0]  # forged ticket
        assert gate_code(path, ticket_of(a)[0], "tok-b") == Code.PERMISSION_DENIED.value[0]  # a's ticket, b's token
        parent = os.path.dirname(path)
        assert oct(os.stat(parent).st_mode & 0o777) == "0o700"
        os.chmod(parent, 0o711)  # past the modes: SO_PEERCRED still says no
        os.chmod(path, 0o666)
        try:
            assert gate_code(path, ticket_of(a)[0], "tok-a", uid=65534) == Code.PERMISSION_DENIED.value[0]
        finally:
            os.chmod(path, 0o600)
            os.chmod(parent, 0o700)


def gate_code(path: str, ticket: bytes, token: str, uid: int | None = None) -> int:
    """The gate's answer to a hello (from a child of another uid when ``uid`` is given)."""
    if uid is None:
        return _hello_code(path, ticket, token)
    code = (
        f"from tests.integration.test_hostile_shm import _hello_code\n"
        f"print(_hello_code({path!r}, bytes.fromhex({ticket.hex()!r}), {token!r}))\n"
    )
    run = run_as(uid, uid, code, preload=("tests.integration.test_hostile_shm",))
    assert run.returncode == 0, f"the child of uid {uid} failed: {run.stderr[-1000:]}"
    return int(run.stdout.strip().splitlines()[-1])


def _hello_code(path: str, ticket: bytes, token: str) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(path)
        try:
            sock.sendall(shmwire.encode_hello(ticket, token))
        except BrokenPipeError:  # refused before the hello: read why
            pass
        data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        for fd in fds:
            os.close(fd)
        return shmwire.decode_reply(data[: shmwire.REPLY.size]).code
    finally:
        sock.close()


def test_a_failed_put_evicts_nothing(fresh):
    """The issue's story: readers hold leases on every fourth 1 MiB object of a full 16 MiB
    pool, so no 4 MiB hole can ever be made; the 4 MiB put is NO_ROOM and evicts nothing."""
    objects = Objects(4 * MiB)
    mine = keys(16, seed=4)
    with StoreClient(fresh.target, "tok-a") as a, StoreClient(fresh.target, "tok-a-ro") as reader:
        for i, key in enumerate(mine):
            assert a.put_shm(key, objects.make(key, 1 * MiB, seed=i)) == pb.PUT_OUTCOME_STORED
        held = [reader.call("Get", get_request(mine[i], lease_ms=60_000)) for i in (3, 7, 11, 15)]
        assert [g.offset for g in held] == [i * MiB for i in (3, 7, 11, 15)]
        big = keys(1, seed=5)[0]
        assert a.put_shm(big, objects.make(big, 4 * MiB, seed=99)) == pb.PUT_OUTCOME_NO_ROOM
        assert a.lookup(mine).hits == 16
        assert admin_doc(fresh.target)["tenants"]["a"]["tiers"]["host"]["evictions"] == 0
        reader.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[g.lease_id for g in held]))
        assert a.put_shm(big, objects.make(big, 4 * MiB, seed=99)) == pb.PUT_OUTCOME_STORED  # now it may
    assert wait_until(lambda: quiet(fresh.target))


def test_a_late_writer_cannot_touch_a_reused_slot(fresh):
    """a reserves, stalls past put_ttl; the slot is fenced, never given to a2's puts; a's
    late copy lands in its own slot only, a2's objects stay intact; a's commit (or the end
    of its session) frees the slot."""
    objects = Objects(4 * MiB)
    with StoreClient(fresh.target, "tok-a") as late, StoreClient(fresh.target, "tok-a2") as a2:
        start = late.put_start(keys(1, seed=6)[0], 4 * MiB)
        fence = range(start.offset, start.offset + 4 * MiB)
        assert wait_until(lambda: admin_counters(fresh.target)["puts_fenced"] == 1, timeout=10)
        stored = {}
        for i, key in enumerate(keys(20, seed=7)):  # more than a's pool holds: it evicts,
            # never into the fenced slot
            obj = bytes(objects.make(key, 1 * MiB, seed=200 + i))
            assert wait_until(lambda: admin_counters(fresh.target)["write_throughs_in_flight"] == 0)
            assert a2.put_shm(key, memoryview(obj)) == pb.PUT_OUTCOME_STORED
            got = a2.call("Get", get_request(key))
            a2.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[got.lease_id]))
            assert got.offset not in fence and got.offset + got.length - 1 not in fence
            stored[key] = obj
        late.segment[fence.start : fence.stop] = 0xEE  # the late copy
        out = np.empty(1 * MiB, np.uint8)
        for key, obj in stored.items():  # from the pool, or promoted from SSD
            assert a2.get_shm(key, out) == len(obj) and out.tobytes() == obj
        assert rpc_code(lambda: late.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id))) == Code.NOT_FOUND
        assert admin_counters(fresh.target)["puts_fenced"] == 0
        late.put_start(keys(1, seed=8)[0], 1 * MiB)  # another one, left to expire
        assert wait_until(lambda: admin_counters(fresh.target)["puts_fenced"] == 1, timeout=10)
        late.session.close()  # the session ends: its fenced slot goes
        late.session = None
        assert wait_until(lambda: admin_counters(fresh.target)["puts_fenced"] == 0, timeout=10)
    assert wait_until(lambda: quiet(fresh.target))
