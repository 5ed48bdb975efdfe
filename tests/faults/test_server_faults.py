"""Faults around a real ``kvstore serve``: the server killed mid-stream (clients see
UNAVAILABLE, no hang; a restart on the same SSD directory keeps the objects), a full SSD
(puts still land in host memory, the write-through failures are counted, reads continue),
SIGTERM with a stream in flight (it drains, exit 0, no /dev/shm file left), and a client
killed with ``kill -9`` while holding leases it keeps renewing, or ones its finished reads had
queued for a batched release (they expire, their pins go, and the space comes back, even
the space of an object deleted meanwhile).

Disk full is a real 4 MiB tmpfs mounted by the test (this runs as root here).  Where
``mount`` is refused, the server's RLIMIT_FSIZE is lowered instead (``prlimit``): Python
ignores SIGXFSZ, so every write past the limit fails with EFBIG, as a full disk fails with
ENOSPC; both reach the SSD tier as an OSError during the write.
"""

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import (
    KiB,
    MiB,
    Objects,
    StoreClient,
    chain_keys,
    key_fields,
    random_key,
    rpc_code,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
# A client that stops reading after one frame: without BDP probing the HTTP/2 window stays
# small, so the server is blocked mid-object when the test acts.
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0)]


@pytest.fixture(scope="module")
def objects():
    return Objects(48 * MiB), Objects(48 * MiB)


def test_server_killed_mid_stream_then_restart_keeps_objects(tmp_path, objects):
    send, expect = objects
    key = random_key(np.random.default_rng(1))
    size = 40 * MiB
    proc = StoreProcess(tmp_path, "--host-capacity", "64MiB", "--ssd-dir", str(tmp_path / "ssd")).start()
    try:
        with StoreClient(proc.target) as c:
            assert c.put_stream(key, send.make(key, size, seed=1)) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: c.stats()[1]["ssd.objects"] == 1)
        with StoreClient(proc.target, options=SLOW_READER) as slow:
            frames = slow.call("GetStream", pb.GetRequest(**key_fields(key)), timeout=30)
            first = next(frames)
            assert first.found and first.total_length == size
            proc.kill()
            with pytest.raises(grpc.RpcError) as info:
                for _ in frames:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        proc.start()  # same SSD directory, new port
        with StoreClient(proc.target) as c:
            reply = c.lookup([key])
            assert reply.hits == 1 and list(reply.tiers) == [pb.TIER_SSD]
            out = np.zeros(size, np.uint8)
            assert c.get_stream(key, out) == size
            assert np.array_equal(out, np.frombuffer(expect.make(key, size, seed=1), np.uint8))
        assert proc.terminate() == 0
    finally:
        proc.kill()


@pytest.fixture
def full_disk(tmp_path):
    """A 4 MiB tmpfs at ``tmp_path/ssd`` ("tmpfs"), or None when mounting is refused."""
    mnt = tmp_path / "ssd"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    yield mnt if done.returncode == 0 else None
    if done.returncode == 0:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("how", ["tmpfs", "rlimit_fsize"])
def test_full_ssd_puts_land_in_host_and_reads_continue(tmp_path, objects, full_disk, how):
    send, expect = objects
    if how == "tmpfs" and full_disk is None:
        print("mount -t tmpfs refused here: simulating the full disk with RLIMIT_FSIZE")
        how = "rlimit_fsize"
    ssd = tmp_path / "ssd"
    size, n = 1 * MiB + 4 * KiB, 8  # four of these cannot fit in 4 MiB
    keys = chain_keys(np.random.default_rng(100), n)
    with (
        StoreProcess(
            tmp_path / "work", "--host-capacity", "64MiB", "--ssd-dir", str(ssd), "--ssd-capacity", "1GiB"
        ) as proc,
        StoreClient(proc.target) as c,
    ):
        if how == "rlimit_fsize":
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (512 * KiB, 512 * KiB))
        for i, key in enumerate(keys):
            assert c.put_stream(key, send.make(key, size, seed=i)) == pb.PUT_OUTCOME_STORED
        assert wait_until(lambda: c.stats()[1]["write_throughs_in_flight"] == 0)
        counters = c.stats()[1]
        stored = counters.get("store.write_through.ssd.stored", 0)
        failed = counters.get("store.write_through.ssd.failed", 0)
        assert stored + failed == n and failed >= 5
        assert counters["store.failures.write_through_ssd_failed"] == failed
        assert counters["ssd.put_failures"] == failed and counters["ssd.objects"] == stored
        assert counters["host.objects"] == n
        reply = c.lookup(keys)
        assert reply.hits == n and list(reply.tiers) == [pb.TIER_HOST] * n
        out = np.zeros(size, np.uint8)
        for i, key in enumerate(keys):
            want = np.frombuffer(expect.make(key, size, seed=i), np.uint8)
            assert c.get_shm(key, out) == size and np.array_equal(out, want)
            assert c.get_stream(key, out) == size and np.array_equal(out, want)
        assert list((ssd / "tmp").iterdir()) == []  # failed puts left no temp files
        assert proc.terminate() == 0


def test_sigterm_drains_inflight_stream_and_removes_the_shm_socket(tmp_path, objects):
    send, expect = objects
    key = random_key(np.random.default_rng(2))
    size = 40 * MiB
    proc = StoreProcess(tmp_path, "--host-capacity", "64MiB").start()
    try:
        with StoreClient(proc.target) as c:
            assert c.put_stream(key, send.make(key, size, seed=2)) == pb.PUT_OUTCOME_STORED
            segment = c.hello().shm_socket  # the pools have no name; the gate's socket has
        assert Path(segment).is_socket()
        with StoreClient(proc.target, options=SLOW_READER) as slow:
            watch = health_pb2_grpc.HealthStub(slow.channel).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            frames = slow.call("GetStream", pb.GetRequest(**key_fields(key)), timeout=30)
            first = next(frames)
            os.kill(proc.pid, signal.SIGTERM)
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            with StoreClient(proc.target) as late:  # no new calls once draining

                def refused() -> bool:  # a fresh Hello each time (StoreClient.hello caches)
                    return (
                        rpc_code(lambda: late.call("Hello", pb.HelloRequest(), timeout=5))
                        == grpc.StatusCode.UNAVAILABLE
                    )

                assert wait_until(refused, timeout=5)
            assert proc.running
            out = np.zeros(size, np.uint8)
            for frame in [first, *frames]:
                out[frame.offset : frame.offset + len(frame.data)] = np.frombuffer(frame.data, np.uint8)
        assert np.array_equal(out[256:], np.frombuffer(expect.make(key, size, seed=2), np.uint8)[256:])
        assert proc.terminate(timeout=15) == 0
        assert "kvstore serve: stopped" in proc.log_text()
        assert not Path(segment).exists() and not Path(segment).parent.exists()
    finally:
        proc.kill()


def test_clients_that_give_up_mid_stream_leave_nothing_held(tmp_path, objects):
    """A reader past its deadline mid-GetStream, a writer stalled mid-PutStream until its
    deadline: the server drops the reference and frees the reservation."""
    send = objects[0]
    rng = np.random.default_rng(4)
    size = 16 * MiB
    with StoreProcess(tmp_path, "--host-capacity", "64MiB") as proc, StoreClient(proc.target) as c:
        key = random_key(rng)
        assert c.put_stream(key, send.make(key, size)) == pb.PUT_OUTCOME_STORED
        base = c.stats()[1]["host.bytes_used"]
        with StoreClient(proc.target, options=SLOW_READER) as slow:
            frames = slow.call("GetStream", pb.GetRequest(**key_fields(key)), timeout=1.0)
            next(frames)
            assert c.stats()[1]["host.refs_held"] == 1
            with pytest.raises(grpc.RpcError) as info:
                for _ in frames:
                    time.sleep(0.5)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(lambda: c.stats()[1]["host.refs_held"] == 0, timeout=5)

        other = random_key(rng)
        obj = bytes(send.make(other, size))

        def stalled():
            yield pb.PutFrame(start=pb.PutStartRequest(size=size, **key_fields(other)))
            yield pb.PutFrame(data=obj[:MiB])
            time.sleep(2.0)  # past the deadline; the rest never comes
            yield pb.PutFrame(data=obj[MiB:])

        assert rpc_code(lambda: c.call("PutStream", stalled(), timeout=1.0)) == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(lambda: c.stats()[1]["puts_in_flight"] == 0, timeout=5)
        counters = c.stats()[1]
        assert counters["host.bytes_used"] == base and counters["host.pending"] == 0
        assert c.lookup([other]).hits == 0
        assert c.put_stream(other, memoryview(obj)) == pb.PUT_OUTCOME_STORED


CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from kvstore._proto import kvstore_pb2 as pb
from tests.kits.store_calls import StoreClient
c = StoreClient(sys.argv[2])
ids = []
for line in sys.argv[3:]:
    ns, h = line.split(":")
    reply = c.call("Get", pb.GetRequest(namespace=bytes.fromhex(ns), chunk_hash=bytes.fromhex(h), tag="r0"))
    assert reply.found
    ids.append(reply.lease_id)
print("held", len(ids), flush=True)
while True:  # a long copy: keep renewing, as a real client does before half the TTL
    for lease_id in ids:
        c.call("RenewLease", pb.RenewLeaseRequest(lease_id=lease_id))
    time.sleep(0.2)
"""


def test_client_killed_holding_leases_they_expire_and_space_returns(tmp_path, objects):
    send = objects[0]
    rng = np.random.default_rng(3)
    size = 2 * MiB
    with StoreProcess(tmp_path, "--host-capacity", "8MiB", "--lease-ttl", "1") as proc, StoreClient(proc.target) as c:
        keys = [random_key(rng) for _ in range(4)]
        for key in keys:
            assert c.put_shm(key, send.make(key, size)) == pb.PUT_OUTCOME_STORED
        args = [f"{bytes(k.namespace).hex()}:{bytes(k.chunk_hash).hex()}" for k in keys]
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ROOT), proc.target, *args], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "held 4"
            # (renewals outliving the TTL: tests/unit/test_server_core.py and test_server.py)
            assert c.stats()[1]["leases_held"] == 4
            extra = random_key(rng)
            assert c.put_shm(extra, send.make(extra, size)) == pb.PUT_OUTCOME_NO_ROOM
            child.send_signal(signal.SIGKILL)
            child.wait()
            assert wait_until(lambda: c.stats()[1]["leases_held"] == 0, timeout=5)
            counters = c.stats()[1]
            assert counters["leases_expired"] >= 4
            assert c.put_shm(extra, send.make(extra, size)) == pb.PUT_OUTCOME_STORED
            assert c.lookup([extra]).hits == 1
        finally:
            child.kill()
            child.wait()


QUEUED = """
import asyncio, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from kvstore.client.store_client import StoreClient
from kvstore.keys import ObjectKey

async def main():
    client = await StoreClient.connect(sys.argv[2], transport="shm", release_delay_s=60)
    buf = np.empty(int(sys.argv[3]), np.uint8)
    for raw in sys.argv[4:]:
        assert await client.read_into(ObjectKey.from_bytes(bytes.fromhex(raw)), memoryview(buf)) == len(buf)
    assert client.counters.releases_deferred == len(sys.argv) - 4
    print("read", client.counters.releases_deferred, flush=True)
    await asyncio.sleep(3600)  # killed here: the releases are still queued

asyncio.run(main())
"""


def test_client_killed_with_queued_releases_they_expire_and_pins_go(tmp_path, objects):
    """A reader whose copies were good leaves its releases queued (60 s batching delay) and
    is killed: the leases pin their slots until the reaper expires them (1 s TTL), even the
    slot of an object deleted meanwhile; then every byte comes back."""
    send = objects[0]
    rng = np.random.default_rng(4)
    size = 2 * MiB
    with StoreProcess(tmp_path, "--host-capacity", "8MiB", "--lease-ttl", "1") as proc, StoreClient(proc.target) as c:
        base = c.stats()[1]["host.bytes_used"]
        keys = [random_key(rng) for _ in range(4)]
        for key in keys:
            assert c.put_shm(key, send.make(key, size)) == pb.PUT_OUTCOME_STORED
        child = subprocess.Popen(
            [sys.executable, "-c", QUEUED, str(ROOT), proc.target, str(size), *(bytes(k).hex() for k in keys)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline().strip() == "read 4"
            counters = c.stats()[1]
            assert (counters["leases_held"], counters["host.refs_held"]) == (4, 4)
            assert c.delete(keys[0])  # hidden, but its slot pinned
            extra = random_key(rng)
            assert c.put_shm(extra, send.make(extra, size)) == pb.PUT_OUTCOME_NO_ROOM
            child.send_signal(signal.SIGKILL)
            child.wait()
            assert wait_until(lambda: c.stats()[1]["host.refs_held"] == 0, timeout=5)
            counters = c.stats()[1]
            assert (counters["leases_held"], counters["host.doomed"]) == (0, 0)
            assert counters["host.bytes_used"] == base + 3 * size
            assert counters["leases_expired"] == 3  # the deleted object's lease ended with it
            assert c.put_shm(extra, send.make(extra, size)) == pb.PUT_OUTCOME_STORED
            assert c.lookup([extra]).hits == 1 and c.lookup([keys[0]]).hits == 0
        finally:
            child.kill()
            child.wait()
