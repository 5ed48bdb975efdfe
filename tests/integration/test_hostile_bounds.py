"""Issue 23, part 1: bounds on what a client can make a real ``kvstore serve`` hold.  In each
test the attack runs (its attempts are counted) and fails: the server refuses or cuts the
attacker while tenant a keeps being served (docs/store-bounds.md)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from tests.kits.attacks import Silent, Trickle, describe
from tests.kits.data_channel import RawData, ticket_of
from tests.kits.hostile import QUOTAS, admin_counters, keys, open_now, quiet, refused, start_store
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, rpc_code, wait_until

Code = grpc.StatusCode
MAX_RPCS = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = start_store(tmp_path_factory.mktemp("hostile-bounds"), "--max-concurrent-rpcs", str(MAX_RPCS))
    yield proc
    assert proc.terminate(30) == 0


@pytest.fixture(scope="module")
def objects():
    return Objects(4 * MiB)


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_refused_put_streams_end_at_once_and_hold_no_rpc_slot(store, objects):
    """While b's 2 streams are in use, b's read-only token opens PutStreams it may not and b
    opens more streams: each is refused at once (counted) while its client still sends (a
    refused stream is drained only under one of its tenant's streams), so 2 x MAX_RPCS
    refused streams never fill the server's call slots and a's puts and hellos go on."""
    before = refused(store.target, "tok-b")
    mine = keys(3, seed=300)
    with (
        StoreClient(store.target, "tok-b") as b,
        StoreClient(store.target, "tok-b-ro") as ro,
        StoreClient(store.target, "tok-a") as a,
    ):
        holders = [Trickle(b, k, 256 * MiB) for k in keys(2, seed=301)]  # b's 2 streams, held
        attacks: list[Trickle] = []
        try:
            assert wait_until(lambda: b.stats()[1]["held.streams"] == 2, timeout=15)
            for i, k in enumerate(keys(2 * MAX_RPCS, seed=302)):
                t = Trickle(ro if i % 2 else b, k, 64 * KiB)
                attacks.append(t)
                assert wait_until(lambda: t.code is not None, timeout=30)
            assert all(t.while_sending for t in attacks)
            codes = [t.code for t in attacks]
            assert codes == [Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED] * MAX_RPCS
            assert all(h.code is None for h in holders)  # still held
            for k in mine:  # a is served
                assert a.put_stream(k, objects.make(k, 256 * KiB)) == pb.PUT_OUTCOME_STORED
            assert a.hello().tenant == "a"
        finally:
            for t in (*attacks, *holders):
                t.stop()
    assert grown(before, refused(store.target, "tok-b")) == {
        "streams": MAX_RPCS,
        "permission": MAX_RPCS,
        "host_bytes": 2,
    }  # the holders: no room
    assert wait_until(lambda: quiet(store.target), timeout=30)


def test_a_read_only_token_cannot_take_the_ticket_table(store):
    """b's read-only token mints OpenData tickets and never uses them: it is refused at its
    own ticket budget (counted), and a still gets tickets and opens data connections."""
    before = refused(store.target, "tok-b-ro")
    minted, code = 0, Code.OK
    with StoreClient(store.target, "tok-b-ro") as ro:
        while minted < 5000:
            code = rpc_code(lambda: ro.call("OpenData", pb.OpenDataRequest()))
            if code is not Code.OK:
                break
            minted += 1
        assert code is Code.RESOURCE_EXHAUSTED
        assert rpc_code(lambda: ro.call("OpenData", pb.OpenDataRequest())) is Code.RESOURCE_EXHAUSTED
    assert minted == 64  # b's default ticket budget
    assert grown(before, refused(store.target, "tok-b-ro")) == {"tickets": 2}
    with StoreClient(store.target, "tok-a") as a:
        for _ in range(3):
            ticket, port = ticket_of(a)
            with RawData(port) as raw:
                assert raw.hello(ticket, "tok-a")[0].code == 0


def test_calls_without_a_token_or_without_a_request_hold_no_call_slot(store):
    """3 x MAX_RPCS calls with no token that never send their request are refused at once
    (counted, before any request is read); calls with b's token that never send theirs are
    cut after request_timeout; a's hellos and lookups are served all along."""
    before = admin_counters(store.target)
    channel = grpc.insecure_channel(store.target)
    calls: list[Silent] = []
    try:
        grpc.channel_ready_future(channel).result(timeout=20)
        for i in range(3 * MAX_RPCS):
            calls.append(Silent(channel, ("Hello", "Lookup", "GetStream", "OpenData")[i % 4]))
        with StoreClient(store.target, "tok-b") as b:  # b's own: cut when late
            late = [Silent(b.channel, m, "tok-b") for m in ("Hello", "Lookup")]
            calls += late
            assert wait_until(lambda: all(c.code is not None for c in calls), timeout=30)
        assert all(c.while_silent for c in calls)
        assert [c.code for c in calls] == [Code.UNAUTHENTICATED] * (3 * MAX_RPCS) + [Code.DEADLINE_EXCEEDED] * 2
        with StoreClient(store.target, "tok-a") as a:
            for _ in range(MAX_RPCS + 1):
                assert a.call("Hello", pb.HelloRequest()).tenant == "a"
            assert a.lookup(keys(2, seed=310)).hits == 0
    finally:
        for c in calls:
            c.stop()
        channel.close()
    after = admin_counters(store.target)
    unauthenticated = "store.failures.grpc_unauthenticated"
    assert after[unauthenticated] - before.get(unauthenticated, 0) == 3 * MAX_RPCS
    assert after["store.failures.grpc_request_timeout"] - before.get("store.failures.grpc_request_timeout", 0) == 2


def test_descriptions_count_against_their_tenant(tmp_path, objects):
    """b describes 40 objects it holds with the most tokens a call allows (256 KiB each):
    beyond its 1 MiB of descriptions it is refused (counted on /metrics) and holds no more,
    while a's descriptions are taken."""
    quotas = {**QUOTAS, "b": {**QUOTAS["b"], "described_bytes": "1MiB"}}
    proc = start_store(tmp_path, "--kv-events", f"ipc://{tmp_path}/{{tenant}}.events", quotas=quotas)
    try:
        mine, theirs = keys(3, seed=320), keys(40, seed=321)
        with StoreClient(proc.target, "tok-b") as b, StoreClient(proc.target, "tok-a") as a:
            for k in theirs:
                assert b.put_stream(k, objects.make(k, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            codes = describe(b, theirs, 65536)
            assert codes == [Code.OK] * 3 + [Code.RESOURCE_EXHAUSTED] * 37  # 3 x (256 KiB + entry)
            held = b.stats()[1]
            assert held["held.described"] == 3 and held["held.described_bytes"] <= MiB
            assert held["refused.described_bytes"] == 37
            for k in mine:
                assert a.put_stream(k, objects.make(k, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            assert describe(a, mine, 256) == [Code.OK] * 3
            assert a.stats()[1]["held.described"] == 3
        metrics = urllib.request.urlopen(proc.metrics_url, timeout=10).read().decode()
        assert 'kvstore_server_tenant_refused_total{tenant="b",what="described_bytes"} 37.0' in metrics
    finally:
        assert proc.terminate(30) == 0


STRANGERS = 600  # more than the data channel's 512 global connection slots


def test_strangers_holding_data_connections_take_no_slot_of_a(store):
    """600 connections from 127.0.0.2 that never send a hello: at most 16 are held (the
    rest closed at once, counted), none takes a global slot, and those held are cut after
    hello_timeout, while a (from 127.0.0.1) opens data connections all along."""
    before = admin_counters(store.target)
    socks: list[socket.socket] = []
    with StoreClient(store.target, "tok-a") as a:
        port = ticket_of(a)[1]
        try:
            for _ in range(STRANGERS):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=20, source_address=("127.0.0.2", 0)))
            for _ in range(3):
                ticket, _ = ticket_of(a)
                with RawData(port) as raw:
                    assert raw.hello(ticket, "tok-a")[0].code == 0
            assert sum(open_now(s) for s in socks) <= 16
            assert wait_until(lambda: not any(open_now(s) for s in socks), timeout=30)  # cut: no hello
        finally:
            for s in socks:
                s.close()
    grown_ = admin_counters(store.target)["store.failures.data_unauthenticated_per_peer"] - before.get(
        "store.failures.data_unauthenticated_per_peer", 0
    )
    assert grown_ >= STRANGERS - 16 * 8  # refused at once (a few more were held if some were cut meanwhile)


GATE_ATTACKER = r"""
import json, socket, sys, time
from tests.kits.hostile import open_now
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
print(json.dumps({"opened": len(socks)}), flush=True)
sys.stdin.readline()
print(json.dumps({"open": sum(open_now(s) for s in socks)}), flush=True)
deadline = time.monotonic() + 60
while any(open_now(s) for s in socks) and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"open": sum(open_now(s) for s in socks)}), flush=True)
"""
GATE_STRANGERS = 1100  # more than the gate's 1024 sessions


def test_strangers_holding_gate_connections_take_no_session_of_a(store):
    """Another process of the server's uid opens 1100 gate connections and never sends a
    hello: at most 16 are held (the rest closed at once, counted) and those are cut after
    hello_timeout, while a opens its shared-memory sessions all along."""
    before = admin_counters(store.target)
    with StoreClient(store.target, "tok-a") as a:
        path = a.hello().shm_socket
        attacker = subprocess.Popen(
            [sys.executable, "-c", GATE_ATTACKER, path, str(GATE_STRANGERS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )  # the kit imports from here
        try:
            assert json.loads(attacker.stdout.readline()) == {"opened": GATE_STRANGERS}
            for _ in range(3):
                with StoreClient(store.target, "tok-a") as session_a:
                    assert session_a.open_session().session_id
            attacker.stdin.write("report\n")
            attacker.stdin.flush()
            assert json.loads(attacker.stdout.readline())["open"] <= 16
            assert json.loads(attacker.stdout.readline()) == {"open": 0}  # cut: no hello
        finally:
            attacker.kill()
            attacker.wait()
    grown_ = admin_counters(store.target)["store.failures.shm_unauthenticated_per_peer"] - before.get(
        "store.failures.shm_unauthenticated_per_peer", 0
    )
    assert grown_ >= GATE_STRANGERS - 16 * 8


def replayed(endpoint: str) -> list[tuple[int, int]]:
    """(seq, payload bytes) of every batch a stream's replay socket holds."""
    import zmq

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if not payload and not _topic:
                return got
            got.append((int.from_bytes(seq, "big"), len(payload)))
    finally:
        dealer.close(0)
        ctx.term()


def test_a_tenant_churning_described_objects_keeps_a_bounded_replay_buffer(tmp_path, objects):
    """b describes one object with 65,536 tokens, then puts and deletes it 24 times: each put
    announces it again, tokens and all (~320 KiB a batch).  b's replay buffer keeps at most
    1 MiB of them, the oldest dropped; a's stream keeps its own batches."""
    proc = start_store(
        tmp_path,
        "--kv-events",
        f"ipc://{tmp_path}/{{tenant}}.events",
        "--kv-events-replay",
        f"ipc://{tmp_path}/{{tenant}}.replay",
        "--kv-events-buffer-bytes",
        "1MiB",
    )
    try:
        k, mine = keys(1, seed=330)[0], keys(1, seed=331)[0]
        with StoreClient(proc.target, "tok-b") as b, StoreClient(proc.target, "tok-a") as a:
            assert a.put_stream(mine, objects.make(mine, 64 * KiB)) == pb.PUT_OUTCOME_STORED
            assert describe(a, [mine], 256) == [Code.OK]
            assert describe(b, [k], 65536) == [Code.OK]
            for i in range(24):
                assert b.put_stream(k, objects.make(k, 64 * KiB, seed=i)) == pb.PUT_OUTCOME_STORED
                assert wait_until(lambda: admin_counters(proc.target)["write_throughs_in_flight"] == 0)
                assert b.delete(k)
            assert wait_until(lambda: replayed(f"ipc://{tmp_path}/b.replay")[-1][0] >= 24, timeout=30)
        theirs = replayed(f"ipc://{tmp_path}/b.replay")
        assert sum(n for _, n in theirs) <= MiB and theirs[0][0] > 0  # the oldest went first
        assert [seq for seq, _ in replayed(f"ipc://{tmp_path}/a.replay")][0] == 0  # a's: all kept
    finally:
        assert proc.terminate(30) == 0
