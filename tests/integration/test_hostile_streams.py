"""Hostile tenants against streams, quotas and server state of a real ``kvstore serve``
(issue 12, attacks 2 and 6): a slow PutStream and a stalled GetStream, on gRPC and on the
data channel, are cut by their deadlines and give back what they held while a's puts go on;
each tenant quota refuses with RESOURCE_EXHAUSTED, counted per tenant, without touching
another tenant; gRPC and the data channel bound calls and idle connections."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.testing.serve_proc import StoreProcess
from kvstore.wire import data as wire
from tests.kits.attacks import StalledPut
from tests.kits.data_channel import RawData, ticket_of
from tests.kits.hostile import admin_counters, get_request, keys, quiet, refused, start_store
from tests.kits.store_calls import MiB, Objects, StoreClient, key_fields, rpc_code, wait_until

Code = grpc.StatusCode
SLOW_READER = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 0)]
EXHAUSTED = Code.RESOURCE_EXHAUSTED


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = start_store(tmp_path_factory.mktemp("hostile-streams"))
    yield proc
    assert proc.terminate(30) == 0


@pytest.fixture(scope="module")
def objects():
    return Objects(24 * MiB)


def test_a_slow_put_stream_is_cut_and_a_still_puts(store, objects):
    key, mine = keys(1, seed=10)[0], keys(4, seed=11)
    with StoreClient(store.target, "tok-b") as b, StoreClient(store.target, "tok-a") as a:
        stall = StalledPut(b, key, objects.make(key, 8 * MiB), 8 * MiB)
        try:
            for k in mine:  # a's puts meanwhile
                assert a.put_stream(k, objects.make(k, 2 * MiB)) == pb.PUT_OUTCOME_STORED
            assert wait_until(lambda: stall.code is not None, timeout=15)
            assert stall.code is Code.DEADLINE_EXCEEDED
        finally:
            stall.stop()
        assert a.lookup(mine).hits == 4 and b.lookup([key]).hits == 0
    assert refused(store.target, "tok-b")["stream_deadline"] >= 1
    assert wait_until(lambda: quiet(store.target))


def test_a_stalled_get_stream_is_cut_and_gives_its_object_back_even_after_delete(store, objects):
    key = keys(1, seed=12)[0]
    with StoreClient(store.target, "tok-a") as a, StoreClient(store.target, "tok-a-ro", options=SLOW_READER) as ro:
        assert a.put_stream(key, objects.make(key, 12 * MiB)) == pb.PUT_OUTCOME_STORED
        assert wait_until(lambda: admin_counters(store.target)["write_throughs_in_flight"] == 0)
        frames = ro.call("GetStream", pb.GetRequest(**key_fields(key)), timeout=60)
        assert next(frames).found  # ... and then it reads no more
        assert admin_counters(store.target)["host.refs_held"] == 1
        assert a.delete(key)  # hidden at once, freed when the pin goes
        assert wait_until(lambda: admin_counters(store.target)["host.refs_held"] == 0, timeout=15)
        assert rpc_code(lambda: list(frames)) is Code.DEADLINE_EXCEEDED
    assert wait_until(lambda: quiet(store.target))


def test_the_data_channel_cuts_stalled_puts_and_gets(store, objects):
    key, big = keys(2, seed=13)
    with StoreClient(store.target, "tok-a") as a:
        assert a.put_stream(big, objects.make(big, 16 * MiB)) == pb.PUT_OUTCOME_STORED
        ticket, port = ticket_of(a)
        with RawData(port) as slow_put, RawData(port) as slow_get:
            assert slow_put.hello(ticket, "tok-a")[0].code == 0
            assert slow_get.hello(ticket_of(a)[0], "tok-a")[0].code == 0
            slow_put.sock.sendall(wire.encode_request(wire.Op.PUT, key, 8 * MiB))
            slow_put.sock.sendall(objects.make(key, 8 * MiB)[:MiB])  # 1 of 8 MiB, then silence
            slow_get.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            slow_get.sock.sendall(wire.encode_request(wire.Op.GET, big))  # and never read the reply
            assert wait_until(lambda: slow_put.closed_by_server(), timeout=15)
            assert wait_until(lambda: quiet(store.target), timeout=15)
        assert a.lookup([key]).hits == 0
    assert refused(store.target, "tok-a")["stream_deadline"] >= 2


def test_quotas_refuse_with_resource_exhausted_counted_per_tenant(store, objects):
    mine, theirs = keys(6, seed=14), keys(6, seed=15)
    before = {t: refused(store.target, t) for t in ("tok-a", "tok-b")}
    with StoreClient(store.target, "tok-b") as b, StoreClient(store.target, "tok-a") as a:
        for k in (*mine, *theirs):
            client = a if k in mine else b
            assert client.put_stream(k, objects.make(k, 256 * 1024)) == pb.PUT_OUTCOME_STORED
        held = [b.call("Get", get_request(k)) for k in theirs[:4]]  # b's 4 leases
        assert rpc_code(lambda: b.call("Get", get_request(theirs[4]))) is EXHAUSTED
        a_held = [a.call("Get", get_request(k)) for k in mine]  # a unaffected
        assert all(g.found for g in a_held)
        starts = [b.put_start(k, 256 * 1024) for k in keys(2, seed=16)]  # b's 2 reservations
        assert rpc_code(lambda: b.put_start(keys(1, seed=17)[0], 256 * 1024)) is EXHAUSTED
        a_start = a.put_start(keys(1, seed=18)[0], 256 * 1024)
        big = keys(1, seed=20)[0]  # longer than a window
        assert b.put_stream(big, objects.make(big, 8 * MiB)) == pb.PUT_OUTCOME_STORED
        with StoreClient(store.target, "tok-b", options=SLOW_READER) as slow:
            streams = [slow.call("GetStream", pb.GetRequest(**key_fields(big)), timeout=30) for _ in range(2)]
            for s in streams:  # b's 2 streams, stalled
                next(s)
            assert rpc_code(lambda: list(b.call("GetStream", pb.GetRequest(**key_fields(theirs[2]))))) is EXHAUSTED
            for s in streams:
                s.cancel()
        grown = {
            t: {k: v - before[t].get(k, 0) for k, v in refused(store.target, t).items() if v != before[t].get(k, 0)}
            for t in before
        }
        assert grown == {"tok-b": {"leases": 1, "reservations": 1, "streams": 1}, "tok-a": {}}
        metrics = urllib.request.urlopen(store.metrics_url, timeout=10).read().decode()
        assert 'kvstore_server_tenant_refused_total{tenant="b",what="leases"}' in metrics
        b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[g.lease_id for g in held]))
        for client, start in ((b, starts[0]), (b, starts[1]), (a, a_start)):
            client.call("PutCommit", pb.PutCommitRequest(put_id=start.put_id, abort=True))
        a.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[g.lease_id for g in a_held]))
        again = b.call("Get", get_request(theirs[4]))  # room again
        assert again.found
        b.call("ReleaseLease", pb.ReleaseLeaseRequest(lease_ids=[again.lease_id]))
    assert wait_until(lambda: quiet(store.target), timeout=15)


def test_b_connections_are_capped_and_idle_ones_are_closed(store):
    with StoreClient(store.target, "tok-b") as b:
        port = ticket_of(b)[1]
        conns = [RawData(port) for _ in range(7)]
        try:
            codes = [raw.hello(ticket_of(b)[0], "tok-b")[0].code for raw in conns[:5]]
            assert codes == [0] * 5  # b's shared-memory session is the 6th
            b.open_session()
            assert conns[5].hello(ticket_of(b)[0], "tok-b")[0].code == EXHAUSTED.value[0]
            assert wait_until(lambda: all(raw.closed_by_server() for raw in conns[:5]), timeout=15)  # idle
        finally:
            for raw in conns:
                raw.close()


def test_grpc_bounds_calls_at_once(tmp_path, objects):
    key = keys(1, seed=19)[0]
    with (
        StoreProcess(
            tmp_path,
            "--host-capacity",
            "64MiB",
            "--max-concurrent-rpcs",
            "3",
            "--stream-min-rate",
            "32MiB",
            "--stream-grace",
            "5",
        ) as proc,
        StoreClient(proc.target, options=SLOW_READER) as c,
    ):
        assert c.put_stream(key, objects.make(key, 16 * MiB)) == pb.PUT_OUTCOME_STORED
        calls = [c.call("GetStream", pb.GetRequest(**key_fields(key)), timeout=30) for _ in range(5)]
        codes = []
        for call in calls:
            try:
                codes.append(Code.OK if next(call).found else None)
            except grpc.RpcError as err:
                codes.append(err.code())
        assert codes.count(Code.OK) == 3 and codes.count(EXHAUSTED) == 2
        for call in calls:
            call.cancel()
