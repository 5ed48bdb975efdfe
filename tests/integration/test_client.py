"""StoreClient against a real ``kvstore serve`` process (StoreProcess): round trips over
shared memory and streams, lookups with tiers, tenants and permissions, leases that expire
mid-read, damaged objects, and the hand-coded stream frames."""

import asyncio
import socket

import grpc
import numpy as np
import pytest
import yaml

from kvstore import codec
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.dataplane import decode_get_frame, encode_data_frame, lookup_requests
from kvstore.client.info import ClientCounters
from kvstore.client.leases import LeaseWindow
from kvstore.client.rpc import Rpc
from kvstore.client.store_client import StoreClient
from kvstore.errors import CapacityError, ConfigError, TierError, TierUnavailableError
from kvstore.keys import Identity, object_keys
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.chain import Chain, namespace, sealed
from tiers.base import PutResult

KiB, MiB = 1 << 10, 1 << 20
NS = namespace("client-test")
CHAIN = Chain(NS)
TOKENS = {
    "ta": ("a", ["read", "write", "shm"]),
    "tb": ("b", ["read", "write", "shm"]),
    "ta-read": ("a", ["read"]),
    "ta-noshm": ("a", ["read", "write"]),
}


@pytest.fixture(scope="module")
def store(store_process):
    return store_process("--host-capacity", "256MiB")


@pytest.fixture(scope="module")
def tenant_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("tenants")
    tokens = work / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {"tokens": [{"token": t, "tenant": ten, "permissions": perms} for t, (ten, perms) in TOKENS.items()]}
        )
    )
    proc = StoreProcess(work, "--host-capacity", "64MiB", "--auth-tokens", str(tokens)).start()
    yield proc
    assert proc.terminate(30) == 0


@pytest.mark.parametrize("transport", ["shm", "stream"])
@pytest.mark.parametrize("size", [KiB, MiB, 3 * MiB + 5, 32 * MiB])
async def test_round_trip(store, transport, size):
    keys = CHAIN.keys(1, seed=size)
    obj = sealed(keys[0], size, seed=size)
    buf = np.zeros(size + 100, np.uint8)
    async with await StoreClient.connect(store.target, transport=transport) as client:
        assert client.uses_shm is (transport == "shm")
        assert await client.put(keys[0], obj) is PutResult.STORED
        assert await client.put(keys[0], obj) is PutResult.EXISTS
        assert tuple(await client.lookup(keys)) == (1, ("host",), (size,))
        assert await client.read_into(keys[0], memoryview(buf)) == size
        assert np.array_equal(buf[:size], obj)  # header rekeyed back to our key
        assert not buf[size:].any()  # nothing written past the object
        assert await client.delete(keys[0]) is True
        assert (await client.lookup(keys)).hits == 0
        assert await client.read_into(keys[0], memoryview(buf)) is None
        c = client.counters
        assert (c.puts, c.put_exists, c.hits, c.misses, c.corrupt, c.bytes_read) == (1, 1, 1, 1, 0, size)


async def test_shm_put_is_read_by_a_stream_client_and_back(store):
    _, hashes, keys = CHAIN.links(2, seed=11)
    objs = [CHAIN.seal(keys[0], 2 * MiB, 1), CHAIN.seal(keys[1], 5 * MiB, 2)]
    async with (
        await StoreClient.connect(store.target, transport="shm") as shm,
        await StoreClient.connect(store.target, transport="stream") as stream,
    ):
        assert await shm.put(keys[0], objs[0]) is PutResult.STORED
        assert await stream.put(keys[1], objs[1], hashes[0]) is PutResult.STORED
        for reader, key, obj in ((stream, keys[0], objs[0]), (shm, keys[1], objs[1])):
            buf = np.empty(len(obj), np.uint8)
            assert await reader.read_into(key, memoryview(buf)) == len(obj)
            assert np.array_equal(buf, obj)
        assert codec.decode_header(objs[1]).parent == hashes[0]
        for key in keys:
            assert await shm.delete(key)


async def test_two_phase_reservation_in_place_and_abort(store):
    keys = CHAIN.keys(2, seed=12)
    obj = sealed(keys[0], 4 * MiB, 3)
    async with await StoreClient.connect(store.target, transport="shm") as client:
        res = await client.reserve(keys[0], len(obj))
        res.buffer[:] = memoryview(obj)  # producers write into the segment
        assert await client.commit(res) is PutResult.STORED
        res = await client.reserve(keys[1], len(obj))
        assert await client.commit(res, ok=False) is PutResult.FAILED  # aborted
        assert (await client.lookup(keys)).hits == 1
        bad = await client.reserve(keys[1], len(obj))
        bad.buffer[:] = memoryview(obj)  # header names keys[0], not keys[1]
        assert await client.commit(bad) is PutResult.FAILED
        assert (await client.lookup(keys[1:])).hits == 0
        assert client.counters.put_failures == 2
        assert await client.delete(keys[0])


async def test_lookup_512_keys_reports_tiers_and_sizes(tmp_path):
    _, hashes, keys = CHAIN.links(512, seed=13)
    objs = [CHAIN.seal(k, 1000 + i, i) for i, k in enumerate(keys)]
    proc = StoreProcess(
        tmp_path, "--host-capacity", "64MiB", "--ssd-dir", str(tmp_path / "ssd"), "--ssd-capacity", "64MiB"
    ).start()
    try:
        async with await StoreClient.connect(proc.target) as client:
            for i, (key, obj) in enumerate(zip(keys, objs)):
                assert await client.put(key, obj, hashes[i - 1] if i else None) is PutResult.STORED
            found = await client.lookup(keys)
            assert found == (512, ("host",) * 512, tuple(1000 + i for i in range(512)))
            assert client.counters.lookups == 1
            assert await client.delete(keys[300])
            assert (await client.lookup(keys)).hits == 300
        assert proc.terminate(30) == 0  # graceful: write-throughs finish
        proc.restart()
        async with await StoreClient.connect(proc.target) as client:
            assert (await client.lookup(keys)).tiers == ("ssd",) * 300  # a cold host pool
            buf = np.empty(2000, np.uint8)
            for i in range(5):  # promoted into the host pool on read
                assert await client.read_into(keys[i], memoryview(buf)) == 1000 + i
                assert np.array_equal(buf[: 1000 + i], objs[i])
            assert (await client.lookup(keys)).tiers == ("host",) * 5 + ("ssd",) * 295
    finally:
        proc.kill()


async def test_lookup_groups_keys_by_namespace_and_tag(store):
    _, hashes, keys = CHAIN.links(3, seed=14)
    other = object_keys(NS, hashes, tag="r1")
    async with await StoreClient.connect(store.target) as client:
        for key in (*keys, other[0]):
            assert await client.put(key, sealed(key, KiB, 5)) is PutResult.STORED
        assert (await client.lookup([*keys, other[0], other[1]])).hits == 4
        assert (await client.lookup([*keys, other[1], other[0]])).hits == 3
        for key in (*keys, other[0]):
            assert await client.delete(key)


async def test_tenants_are_isolated_and_permissions_enforced(tenant_store):
    keys = CHAIN.keys(2, seed=15)
    obj = sealed(keys[0], 2 * MiB, 6)
    buf = np.empty(len(obj), np.uint8)
    target = tenant_store.target
    async with (
        await StoreClient.connect(target, token="ta") as a,
        await StoreClient.connect(target, token="tb") as b,
        await StoreClient.connect(target, token="ta-read") as reader,
    ):
        assert a.uses_shm and b.uses_shm and not reader.uses_shm
        assert (a.info.tenant, b.info.tenant) == ("a", "b")
        assert await a.put(keys[0], obj) is PutResult.STORED
        assert (await b.lookup(keys[:1])).hits == 0  # B cannot detect it
        assert await b.read_into(keys[0], memoryview(buf)) is None
        assert await b.delete(keys[0]) is False  # nor delete it
        assert await b.put(keys[0], obj) is PutResult.STORED  # B's own copy
        assert await reader.read_into(keys[0], memoryview(buf)) == len(obj)  # same tenant as A
        assert np.array_equal(buf, obj)
        assert await reader.put(keys[1], sealed(keys[1], KiB, 7)) is PutResult.FAILED
        assert reader.counters.put_failures == 1
        assert (await a.lookup(keys)).hits == 1
        assert await a.delete(keys[0]) and await b.delete(keys[0])


async def test_transport_follows_the_shm_permission(tenant_store):
    target = tenant_store.target
    async with await StoreClient.connect(target, token="ta-noshm") as auto:
        assert not auto.uses_shm and "shm permission" in auto.shm_refusal
        keys = CHAIN.keys(1, seed=16)
        obj = sealed(keys[0], MiB, 8)
        assert await auto.put(keys[0], obj) is PutResult.STORED  # streamed
        assert await auto.delete(keys[0])
    with pytest.raises(ConfigError, match="shm permission"):
        await StoreClient.connect(target, token="ta-noshm", transport="shm")
    async with await StoreClient.connect(target, token="ta", transport="auto") as auto:
        assert auto.uses_shm and auto.shm_refusal == ""
    for token in (None, "wrong"):
        with pytest.raises(TierError, match="UNAUTHENTICATED"):
            await StoreClient.connect(target, token=token)


async def _put_stream_code(target: str, token: str, frames: list[bytes]) -> grpc.StatusCode:
    """Status of a PutStream of ``frames`` from a grpc.aio client writing them all."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.stream_unary("/kvstore.v1.KVStore/PutStream")(
            metadata=(("authorization", f"Bearer {token}"),), timeout=20
        )
        try:
            for frame in frames:
                await call.write(frame)
            await call.done_writing()
            await call
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_refused_put_streams_get_their_real_status(tenant_store):
    """The server reads a refused stream to its end before answering, so an aio client that
    is still writing sees PERMISSION_DENIED / INVALID_ARGUMENT / RESOURCE_EXHAUSTED rather
    than "INTERNAL: Internal error from Core"; nothing is stored or left reserved."""
    keys = CHAIN.keys(1, seed=28)
    target = tenant_store.target

    def frames(size: int, **start) -> list[bytes]:
        obj = sealed(keys[0], size, 57)
        head = pb.PutFrame(
            start=pb.PutStartRequest(namespace=keys[0][:32], chunk_hash=keys[0][32:64], tag="r0", size=size, **start)
        )
        return [
            head.SerializeToString(),
            *(encode_data_frame(memoryview(obj)[o : o + MiB]) for o in range(0, size, MiB)),
        ]

    for size in (8 * KiB, 4 * MiB):
        for _ in range(3):
            assert await _put_stream_code(target, "ta-read", frames(size)) is grpc.StatusCode.PERMISSION_DENIED
    bad_tag = frames(4 * MiB)
    bad_tag[0] = pb.PutFrame(
        start=pb.PutStartRequest(namespace=keys[0][:32], chunk_hash=keys[0][32:64], tag="no spaces", size=4 * MiB)
    ).SerializeToString()
    assert await _put_stream_code(target, "ta", bad_tag) is grpc.StatusCode.INVALID_ARGUMENT
    async with await StoreClient.connect(target, token="ta") as a:
        too_big = frames(2 * MiB)
        too_big[0] = pb.PutFrame(
            start=pb.PutStartRequest(
                namespace=keys[0][:32], chunk_hash=keys[0][32:64], tag="r0", size=a.info.max_object_bytes + 1
            )
        ).SerializeToString()
        assert await _put_stream_code(target, "ta", too_big) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await a.lookup(keys)).hits == 0
        counters = (await a.stats())["server_counters"]
        assert (counters["puts_in_flight"], counters["host.pending"]) == (0, 0)
        assert await _put_stream_code(target, "ta", frames(4 * MiB)) is grpc.StatusCode.OK
        assert (await a.lookup(keys)).hits == 1 and await a.delete(keys[0])


@pytest.mark.parametrize("size", [KiB, 4 * MiB])
async def test_expired_lease_at_completion_is_a_miss(tmp_path, size):
    """``_after_copy`` (a test hook) pauses between the copy and the lease release, longer
    than the server's TTL (the server's clock is real: this needs a real pause)."""
    proc = StoreProcess(tmp_path, "--host-capacity", "64MiB", "--lease-ttl", "0.2").start()
    keys = CHAIN.keys(1, seed=17)
    obj = sealed(keys[0], size, 9)
    buf = np.zeros(size, np.uint8)
    try:
        async with (
            await StoreClient.connect(proc.target, transport="shm", _after_copy=lambda: asyncio.sleep(0.3)) as slow,
            await StoreClient.connect(proc.target, transport="shm") as fast,
        ):
            assert await fast.put(keys[0], obj) is PutResult.STORED
            assert await slow.read_into(keys[0], memoryview(buf)) is None
            assert (slow.counters.lease_expired, slow.counters.misses, slow.counters.hits) == (1, 1, 0)
            # past its window the copy was not trusted: the server was asked, and said expired
            assert (slow.counters.releases_deferred, slow.counters.release_calls) == (0, 1)
            assert await fast.read_into(keys[0], memoryview(buf)) == size
            assert np.array_equal(buf, obj)
            assert (fast.counters.releases_deferred, fast.counters.lease_expired) == (1, 0)
    finally:
        assert proc.terminate(30) == 0


async def _server_counters(client: StoreClient) -> dict[str, float]:
    return (await client.stats())["server_counters"]


async def test_same_host_reads_release_their_leases_in_batches(tmp_path):
    """A same-host read is one round trip; its lease is released later, in a batch.  With a
    30 s delay nothing goes until a call's worth (max_keys_per_call 8) is queued or the
    client flushes, and the queued leases keep their slots pinned meanwhile."""
    proc = StoreProcess(tmp_path, "--host-capacity", "64MiB", "--max-keys-per-call", "8").start()
    keys = CHAIN.keys(2, seed=24)
    objs = [sealed(keys[0], 64 * KiB, 52), sealed(keys[1], 4 * MiB, 53)]  # inline; copy thread
    buf = np.zeros(4 * MiB, np.uint8)
    try:
        async with (
            await StoreClient.connect(proc.target, transport="shm", release_delay_s=30) as c,
            await StoreClient.connect(proc.target, transport="stream") as watcher,
        ):
            for key, obj in zip(keys, objs):
                assert await c.put(key, obj) is PutResult.STORED
            base = await _server_counters(watcher)
            for i in range(20):
                obj = objs[i % 2]
                assert await c.read_into(keys[i % 2], memoryview(buf)) == len(obj)
                assert np.array_equal(buf[: len(obj)], obj)
            now = await _server_counters(watcher)
            assert now["store.release_calls"] - base["store.release_calls"] == 2  # 8 + 8
            assert (now["leases_held"], now["host.refs_held"]) == (4, 4)  # queued: pinned
            assert (c.counters.releases_deferred, c.counters.release_calls, c.counters.lease_expired) == (20, 2, 0)
            await c.flush_releases()
            now = await _server_counters(watcher)
            assert now["store.release_calls"] - base["store.release_calls"] == 3
            assert now["store.leases_released"] - base["store.leases_released"] == 20  # all valid
            assert (now["leases_held"], now["host.refs_held"]) == (0, 0)
            assert c.counters.release_calls == 3
    finally:
        assert proc.terminate(30) == 0


async def test_queued_releases_go_by_themselves(store):
    """Without any further call from the reader, its queued releases reach the server within
    a moment (the default delay is milliseconds)."""
    keys = CHAIN.keys(1, seed=25)
    obj = sealed(keys[0], 256 * KiB, 54)
    buf = np.zeros(len(obj), np.uint8)
    async with (
        await StoreClient.connect(store.target, transport="shm") as c,
        await StoreClient.connect(store.target, transport="stream") as watcher,
    ):
        assert await c.put(keys[0], obj) is PutResult.STORED
        base = await _server_counters(watcher)
        got = await asyncio.gather(*(c.read_into(keys[0], memoryview(np.zeros(len(obj), np.uint8))) for _ in range(10)))
        assert got == [len(obj)] * 10 and c.counters.releases_deferred == 10
        for _ in range(100):
            now = await _server_counters(watcher)
            if now["store.leases_released"] - base["store.leases_released"] == 10:
                break
            await asyncio.sleep(0.02)
        assert now["store.leases_released"] - base["store.leases_released"] == 10
        assert (now["leases_held"], now["host.refs_held"]) == (0, 0)
        assert now["store.release_calls"] - base["store.release_calls"] == c.counters.release_calls
        assert await c.read_into(keys[0], memoryview(buf)) == len(obj) and np.array_equal(buf, obj)
        assert await c.delete(keys[0])


async def test_delete_while_leased_frees_the_slot_only_when_the_lease_ends(tmp_path):
    """A lease pins its slot: a Delete hides the object at once, but its bytes stay put and
    its room stays taken until the lease is released (here: a 2 MiB pool, two leased 1 MiB
    objects, so a third object fits exactly when the deleted one's lease ends)."""
    proc = StoreProcess(tmp_path, "--host-capacity", "2MiB").start()
    keys = CHAIN.keys(3, seed=26)
    objs = [sealed(k, MiB, 55 + i) for i, k in enumerate(keys)]
    buf = np.zeros(MiB, np.uint8)
    try:
        async with await StoreClient.connect(proc.target, transport="shm") as c:
            for key, obj in zip(keys[:2], objs[:2]):
                assert await c.put(key, obj) is PutResult.STORED
            leases = [
                await c.rpc.stub.Get(
                    pb.GetRequest(namespace=k[:32], chunk_hash=k[32:64], tag=k.tag), timeout=5, metadata=c.rpc.metadata
                )
                for k in keys[:2]
            ]  # held: never released here
            held = leases[0]
            before = c.planes.segment.array[held.offset : held.offset + MiB].copy()
            assert await c.delete(keys[0]) is True
            assert (await c.lookup(keys[:1])).hits == 0  # hidden at once
            assert await c.read_into(keys[0], memoryview(buf)) is None  # new reads miss
            counters = await _server_counters(c)
            assert (counters["host.bytes_used"], counters["host.doomed"], counters["host.refs_held"]) == (2 * MiB, 1, 2)
            assert await c.put(keys[2], objs[2]) is PutResult.NO_ROOM  # the room is pinned
            assert np.array_equal(c.planes.segment.array[held.offset : held.offset + MiB], before)
            assert await c.reader.release(held.lease_id) is False  # deleted: conservative
            counters = await _server_counters(c)
            assert (counters["host.bytes_used"], counters["host.doomed"], counters["host.refs_held"]) == (MiB, 0, 1)
            assert await c.put(keys[2], objs[2]) is PutResult.STORED  # now it fits
            assert await c.reader.release(leases[1].lease_id) is True
            assert await c.read_into(keys[2], memoryview(buf)) == MiB and np.array_equal(buf, objs[2])
            counters = await _server_counters(c)
            assert (counters["leases_held"], counters["host.refs_held"]) == (0, 0)
    finally:
        assert proc.terminate(30) == 0


async def test_damaged_object_is_a_counted_miss_and_deleted(store):
    keys = CHAIN.keys(1, seed=18)
    obj = sealed(keys[0], 2 * MiB, 10)
    buf = np.empty(len(obj), np.uint8)
    async with await StoreClient.connect(store.target, transport="shm") as client:
        assert await client.put(keys[0], obj) is PutResult.STORED
        got = await client.rpc.stub.Get(
            pb.GetRequest(namespace=keys[0][:32], chunk_hash=keys[0][32:64], tag=keys[0].tag),
            timeout=5,
            metadata=client.rpc.metadata,
        )
        client.planes.segment.array[got.offset + 5000] ^= 0xFF  # damage it in the server's pool
        await client.rpc.stub.ReleaseLease(
            pb.ReleaseLeaseRequest(lease_ids=[got.lease_id]), timeout=5, metadata=client.rpc.metadata
        )
        assert await client.read_into(keys[0], memoryview(buf)) is None
        assert client.counters.corrupt == 1
        assert (await client.lookup(keys)).hits == 0  # deleted on the server


async def test_bad_arguments_raise_clear_errors(store):
    keys = CHAIN.keys(1, seed=19)
    obj = sealed(keys[0], 2 * MiB, 11)
    async with await StoreClient.connect(store.target) as client:
        assert await client.put(keys[0], obj) is PutResult.STORED
        held = (await client.stats())["server"]["leases"]["held"]  # other tests' leases may still expire
        with pytest.raises(ConfigError, match="cannot hold"):
            await client.read_into(keys[0], memoryview(np.empty(MiB, np.uint8)))
        with pytest.raises(ConfigError, match="writable"):
            await client.read_into(keys[0], memoryview(bytes(4 * MiB)))
        with pytest.raises(CapacityError, match="exceeds"):
            await client.put(keys[0], np.zeros(client.info.max_object_bytes + 1, np.uint8))
        assert client.counters.hits == 0
        stats = await client.stats()
        assert stats["server"]["leases"]["held"] <= held  # the refused read let go of its lease
        assert await client.delete(keys[0])
    with pytest.raises(ConfigError, match="transport"):
        await StoreClient.connect(store.target, transport="carrier-pigeon")


async def test_unreachable_store_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TierUnavailableError, match=f"127.0.0.1:{port}"):
        await StoreClient.connect(f"127.0.0.1:{port}", timeout_s=0.3)


def test_frames_match_protobuf():
    rng = np.random.default_rng(0)
    for n in (0, 1, 127, 128, 300, 1 << 20):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        put = pb.PutFrame.FromString(encode_data_frame(memoryview(data)))
        assert put.WhichOneof("frame") == "data" and put.data == data
        for found in (True, False):
            msg = pb.GetFrame(found=found, total_length=n * 3, offset=n, data=data, tier=pb.TIER_SSD)
            got = decode_get_frame(msg.SerializeToString())
            assert (got.found, got.total_length, got.offset, bytes(got.data), got.tier) == (
                found,
                n * 3,
                n,
                data,
                pb.TIER_SSD,
            )
    with pytest.raises(TierError, match="malformed"):
        decode_get_frame(pb.GetFrame(data=b"xyz").SerializeToString()[:-1])


def test_lookup_requests_match_protobuf():
    """Hand-encoded Lookup requests: split into runs of one namespace and tag, at most
    ``limit`` keys each, byte-identical to protobuf's encoding (few keys are encoded in
    Python, many with numpy: both paths)."""
    _, hashes, keys = CHAIN.links(9, seed=27)
    other_ns = Identity("client-test-2", "r", "bf16", "test:opaque", 1, 1, 1).namespace()
    mixed = [*keys[:5], *object_keys(NS, hashes[5:7], tag="rank-10"), *object_keys(other_ns, hashes[7:])]
    runs = [(0, 3), (3, 5), (5, 7), (7, 9)]
    want = [
        (
            pb.LookupRequest(
                namespace=mixed[a][:32], chunk_hashes=[k[32:64] for k in mixed[a:b]], tag=mixed[a].tag
            ).SerializeToString(),
            b - a,
        )
        for a, b in runs
    ]
    assert list(lookup_requests(mixed, 3)) == want
    for n in (1, 9, 16, 17, 600):  # few keys: no numpy; many: numpy
        _, hashes, keys = CHAIN.links(n, seed=n)
        assert list(lookup_requests(keys, 4096)) == [
            (
                pb.LookupRequest(
                    namespace=bytes(NS), chunk_hashes=[bytes(h) for h in hashes], tag="r0"
                ).SerializeToString(),
                n,
            )
        ]
    mixed_many = [*keys[:40], *object_keys(NS, hashes[40:60], tag="rank-10"), *keys[60:100]]
    bounds = [(0, 32), (32, 40), (40, 60), (60, 92), (92, 100)]
    assert list(lookup_requests(mixed_many, 32)) == [
        (
            pb.LookupRequest(
                namespace=bytes(NS), chunk_hashes=[k[32:64] for k in mixed_many[a:b]], tag=mixed_many[a].tag
            ).SerializeToString(),
            b - a,
        )
        for a, b in bounds
    ]
    assert list(lookup_requests([], 8)) == []


def test_lease_window_counts_from_the_last_start():
    window = LeaseWindow(7, start=100.0, ttl_s=0.2)
    assert window.holds(100.18) and not window.holds(100.19)  # 5% + 1 ms of margin
    window.renewed(100.15, 200)
    assert window.holds(100.33) and not window.holds(100.34)


async def test_grpc_codes_are_translated_in_one_place():
    counters = ClientCounters()
    rpc = Rpc(grpc.aio.insecure_channel("h:1"), "h:1", None, 1.0, counters)

    def err(code):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="why")

    cases = {
        grpc.StatusCode.UNAVAILABLE: TierUnavailableError,
        grpc.StatusCode.DEADLINE_EXCEEDED: TierUnavailableError,
        grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
        grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityError,
        grpc.StatusCode.PERMISSION_DENIED: TierError,
    }
    try:
        for code, kind in cases.items():
            e = rpc.error("Get", err(code))
            assert type(e) is kind and code.name in str(e) and "h:1" in str(e)
    finally:
        await rpc.close()
    assert (counters.transport_errors, counters.errors) == (2, 3)


async def test_store_restart_between_calls_remaps_the_segment(tmp_path):
    """No call fails in between, so only the objects tell the client the segment changed:
    the getter's first read finds another object at its offset (a key mismatch: its mapping
    is the old server's pool), the putter's first PutStart names a session the new server
    never opened (refused); each opens a new session once and retries, nothing counts as
    damaged and nothing is deleted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = StoreProcess(
        tmp_path,
        "--listen",
        f"127.0.0.1:{port}",
        "--host-capacity",
        "64MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--ssd-capacity",
        "64MiB",
    ).start()
    keys = CHAIN.keys(3, seed=20)
    objs = [sealed(k, 2 * MiB, 30 + i) for i, k in enumerate(keys)]
    buf = np.empty(2 * MiB, np.uint8)
    try:
        async with (
            await StoreClient.connect(proc.target, transport="shm") as getter,
            await StoreClient.connect(proc.target, transport="shm") as putter,
        ):
            for key, obj in zip(keys[:2], objs[:2]):  # keys[0] first in the old segment
                assert await putter.put(key, obj) is PutResult.STORED
            old = {client: client.planes.segment_id for client in (getter, putter)}  # their sessions
            assert proc.terminate(30) == 0
            proc.start()
            for client in (getter, putter):
                await asyncio.wait_for(client.rpc.channel.channel_ready(), 10)
            assert await getter.read_into(keys[1], memoryview(buf)) == 2 * MiB  # promoted to offset 0
            assert np.array_equal(buf, objs[1])
            assert await putter.put(keys[2], objs[2]) is PutResult.STORED
            for client in (getter, putter):
                assert client.planes.segment_id not in (None, old[client])
                assert (client.counters.corrupt, client.counters.put_failures) == (0, 0)
            assert (await getter.lookup(keys)).hits == 3
    finally:
        proc.kill()


async def test_tls_with_client_certificates(tmp_path):
    from kvstore.testing.tls_files import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    proc = StoreProcess(
        tmp_path,
        "--host-capacity",
        "32MiB",
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        "--tls-client-ca",
        str(tls.ca_cert),
    ).start()
    keys = CHAIN.keys(1, seed=21)
    obj = sealed(keys[0], 2 * MiB, 40)
    buf = np.empty(len(obj), np.uint8)
    mtls = dict(tls_ca=str(tls.ca_cert), tls_cert=str(tls.client_cert), tls_key=str(tls.client_key))
    try:
        for transport in ("shm", "stream"):
            async with await StoreClient.connect(proc.target, transport=transport, **mtls) as client:
                assert await client.put(keys[0], obj) in (PutResult.STORED, PutResult.EXISTS)
                assert await client.read_into(keys[0], memoryview(buf)) == len(obj)
                assert np.array_equal(buf, obj)
        for opts in ({}, {"tls_ca": str(tls.ca_cert)}):  # plaintext; no client certificate
            with pytest.raises(TierUnavailableError):
                await StoreClient.connect(proc.target, timeout_s=1.0, **opts)
        with pytest.raises(ConfigError, match="tls_key"):
            await StoreClient.connect(proc.target, tls_ca=str(tls.ca_cert), tls_cert=str(tls.client_cert))
        with pytest.raises(ConfigError, match="missing.pem"):
            await StoreClient.connect(proc.target, tls_ca=str(tmp_path / "missing.pem"))
    finally:
        assert proc.terminate(30) == 0


async def test_long_copies_renew_their_lease(tmp_path):
    """A 2 ms lease cannot outlast a 256 MiB copy (>= 15 ms at any memcpy speed), so the
    copy renews it every half TTL.  Whether every renewal arrives in time depends on the
    machine, so either answer may come, but each must be consistent: the object's exact
    bytes, or a miss counted as an expired lease."""
    proc = StoreProcess(
        tmp_path, "--host-capacity", "300MiB", "--lease-ttl", "0.002", "--put-ttl", "30", "--max-object-bytes", "256MiB"
    ).start()
    keys = CHAIN.keys(1, seed=22)
    size = 256 * MiB
    obj = sealed(keys[0], size, 50)
    buf = np.zeros(size, np.uint8)
    try:
        async with await StoreClient.connect(proc.target, transport="shm") as client:
            assert await client.put(keys[0], obj) is PutResult.STORED
            got = await client.read_into(keys[0], memoryview(buf))
            c = client.counters
            assert c.renewals >= 1
            if got is None:
                assert (c.lease_expired, c.misses, c.corrupt) == (1, 1, 0)
            else:
                assert got == size and np.array_equal(buf, obj) and c.lease_expired == 0
    finally:
        assert proc.terminate(30) == 0


async def test_renewed_lease_outlives_its_ttl(tmp_path):
    """Two 300 ms leases, one renewed at once: when the other has expired (the server says
    so), the renewed one has outlived its first TTL.  The renewal rules themselves are
    stories on a fake clock in tests/unit/test_server_core.py."""
    proc = StoreProcess(tmp_path, "--host-capacity", "16MiB", "--lease-ttl", "0.3").start()
    keys = CHAIN.keys(2, seed=23)
    try:
        async with await StoreClient.connect(proc.target, transport="shm") as client:
            leases = []
            for key in keys:
                assert await client.put(key, sealed(key, 4096, 51)) is PutResult.STORED
                got = await client.rpc.stub.Get(
                    pb.GetRequest(namespace=key[:32], chunk_hash=key[32:64], tag=key.tag),
                    timeout=5,
                    metadata=client.rpc.metadata,
                )
                leases.append(got.lease_id)
            assert await client.reader.renew(leases[0], 5000) == 5000
            async with asyncio.timeout(10):
                while (await _server_counters(client))["leases_held"] != 1:
                    await asyncio.sleep(0.02)
            assert await client.reader.release(leases[0]) is True  # renewed: still valid
            assert await client.reader.release(leases[1]) is False  # not renewed: expired
            assert await client.reader.renew(leases[1], 300) is None  # unknown now: NOT_FOUND
    finally:
        assert proc.terminate(30) == 0


async def test_the_clients_lease_ttl_is_what_the_server_grants(store):
    """``lease_ttl_s`` (the connector's ``lease_ttl``) is asked for on every Get: a 1 s
    lease on a store whose default is 30 s lapses by itself, while the read's release is
    still queued (60 s batching delay)."""
    keys = CHAIN.keys(1, seed=29)
    buf = np.zeros(8192, np.uint8)
    async with (
        await StoreClient.connect(store.target, transport="shm", lease_ttl_s=1.0, release_delay_s=60) as client,
        await StoreClient.connect(store.target, transport="stream") as watcher,
    ):
        assert client.lease_ms == 1000
        assert await client.put(keys[0], sealed(keys[0], 4096, 7)) is PutResult.STORED
        before = (await _server_counters(watcher))["leases_held"]
        assert await client.read_into(keys[0], memoryview(buf)) == 4096
        assert (await _server_counters(watcher))["leases_held"] == before + 1
        async with asyncio.timeout(10):  # the server's reaper drops it
            while (await _server_counters(watcher))["leases_held"] != before:
                await asyncio.sleep(0.05)
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        await StoreClient.connect(store.target, lease_ttl_s=0)


@pytest.mark.parametrize("transport", ["shm", "stream"])
async def test_more_calls_at_once_than_the_server_takes_all_land(store_process, transport):
    """A framework's batch (SGLang's 128 pages, many vLLM store jobs) opens more calls at
    once than the server takes on one connection (here 8).  The client holds the excess
    (at most half the limit the server said in Hello), so none is refused by the server
    (REFUSED_STREAM, UNAVAILABLE) and every put and read lands.  (48 puts: a same-host put
    holds a reservation between its two calls, and the tenant's quota is 64.)"""
    small = store_process("--host-capacity", "64MiB", "--max-streams-per-connection", "8")
    keys = CHAIN.keys(48, seed=5)
    objs = [sealed(k, 64 * KiB, seed=i) for i, k in enumerate(keys)]
    async with await StoreClient.connect(small.target, transport=transport) as client:
        assert client.rpc.server.max_calls == 8 and client.rpc.max_calls == 4
        puts = await asyncio.gather(*(client.put(k, o) for k, o in zip(keys, objs, strict=True)))
        assert puts == [PutResult.STORED] * len(keys)
        bufs = [np.zeros(64 * KiB, np.uint8) for _ in keys]
        got = await asyncio.gather(*(client.read_into(k, memoryview(b)) for k, b in zip(keys, bufs, strict=True)))
        assert got == [64 * KiB] * len(keys)
        assert all(np.array_equal(b, o) for b, o in zip(bufs, objs, strict=True))
        assert client.counters.transport_errors == 0
