"""KV events of a store (``kvstore.store.kvevents``) and their wire form (``kvstore.wire.kv``),
decoded with vLLM's own msgspec structs.

Stories on a real store core: a 4-slot host pool over an SSD directory.  A chain is saved
(described by its tokens, then written through), a fifth object evicts the oldest chain
tail from the host pool, a damaged SSD object is dropped as corrupt, a delete removes the
rest; a new store on the same directory (a restart) knows what survived and announces it
once a lookup describes it again.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvstore import codec
from kvstore.keys import ROOT
from kvstore.store.kvevents import EventRecorder
from kvstore.store.tiered import TieredStore
from kvstore.wire import kv as kvwire
from kvstore.wire.kv import CPU, LOCAL, STORAGE, Kind, KVEvent, Medium
from tests.kits.chain import Chain, namespace
from tiers.base import Removal
from tiers.host import HostTier
from tiers.ssd import SSDTier

SLOT = 64 * 1024
MEDIA = {"host": Medium(CPU), "ssd": Medium(STORAGE, LOCAL, "ssd")}
VLLM = msgspec.msgpack.Decoder(type=KVEventBatch)
CHAIN = Chain(namespace("events"))


def geometry() -> codec.ObjectGeometry:
    return codec.ObjectGeometry(1, 1, SLOT - codec.HEADER_SIZE - 4096, "bf16", "test:opaque", 16)


async def put(store: TieredStore, key, parent) -> None:
    payload = np.zeros(geometry().payload_bytes, np.uint8)
    await store.put_payload(key, geometry(), payload, parent_hash=parent or ROOT)


def wire(events: list[KVEvent]) -> list:
    """The events as vLLM's own decoder reads them back."""
    return VLLM.decode(kvwire.encode_batch(events, 1.0, epoch=7)).events


def test_wire_hash_is_vllms_low_64_bits():
    h = bytes(range(32))
    assert kvwire.wire_hash(h) == int.from_bytes(h, "big") & ((1 << 64) - 1)
    assert kvwire.wire_hash(b"\xff" * 32) == 2**64 - 1


def test_batch_carries_the_epoch_and_vllm_ignores_it():
    raw = kvwire.encode_batch([KVEvent(Kind.CLEARED)], 2.5, epoch=1234, dp_rank=0)
    assert msgspec.msgpack.decode(raw) == [2.5, [{"type": "AllBlocksCleared"}], 0, 1234]
    batch = VLLM.decode(raw)
    assert batch.ts == 2.5 and batch.events == [AllBlocksCleared()] and batch.data_parallel_rank == 0


async def test_store_eviction_corruption_and_delete_in_order(tmp_path):
    tokens, hashes, keys = CHAIN.links(5)
    host = HostTier(4 * SLOT, alignment=SLOT)
    ssd = await SSDTier.open(tmp_path / "ssd", 64 * SLOT)
    rec = EventRecorder(MEDIA, group_idx=0)
    rec.attach([host, ssd])
    async with TieredStore(host, [ssd]) as store:
        for i in range(4):
            rec.describe(keys[i], hashes[i - 1] if i else None, tokens[i].tolist())
            await put(store, keys[i], hashes[i - 1] if i else None)
        await store.drain()
        first = wire(rec.take())
        assert [type(e) for e in first] == [BlockStored] * 8
        by_medium = {m: [e for e in first if e.medium == m] for m in (CPU, STORAGE)}
        assert [e.block_hashes[0] for e in by_medium[CPU]] == [kvwire.wire_hash(h) for h in hashes[:4]]
        e = by_medium[CPU][1]
        assert e.parent_block_hash == kvwire.wire_hash(hashes[0]) and e.token_ids == tokens[1].tolist()
        assert e.block_size == 16 and e.group_idx == 0 and e.lora_name is None
        assert by_medium[CPU][0].parent_block_hash is None
        assert {(e.locality, e.ownership) for e in by_medium[STORAGE]} == {(LOCAL, "ssd")}

        # A fifth object: the pool holds four, so the chain's tail (keys[3]) is evicted.
        rec.describe(keys[4], hashes[3], tokens[4].tolist())
        await put(store, keys[4], hashes[3])
        await store.drain()
        events = rec.take()
        assert [(e.kind, e.medium.medium, e.block_hash, e.reason) for e in events][:2] == [
            (Kind.REMOVED, CPU, kvwire.wire_hash(hashes[3]), "evicted"),
            (Kind.STORED, CPU, kvwire.wire_hash(hashes[4]), None),
        ]
        removed = wire(events)[0]
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == [kvwire.wire_hash(hashes[3])]

        # Damage keys[3] on SSD: the read drops it as corrupt.
        path = ssd.path_of(keys[3])
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert await ssd.read_into(keys[3], memoryview(bytearray(SLOT))) is None
        assert [(e.kind, e.medium.ownership, e.reason) for e in rec.take()] == [(Kind.REMOVED, "ssd", "corrupt")]

        assert await store.delete(keys[0])
        assert [(e.medium.medium, e.reason) for e in rec.take()] == [(CPU, "deleted"), (STORAGE, "deleted")]
    assert rec.counts["undescribed"] == 0


async def test_restart_knows_survivors_and_announces_them_once_described(tmp_path):
    tokens, hashes, keys = CHAIN.links(3, seed=1)
    async with TieredStore(HostTier(4 * SLOT, alignment=SLOT), [await SSDTier.open(tmp_path, 64 * SLOT)]) as store:
        for i in range(3):
            await put(store, keys[i], hashes[i - 1] if i else None)
    host, ssd = HostTier(4 * SLOT, alignment=SLOT), await SSDTier.open(tmp_path, 64 * SLOT)
    rec = EventRecorder(MEDIA)
    rec.attach([host, ssd])
    rec.clear([""])
    assert [e.kind for e in rec.take()] == [Kind.CLEARED]  # a new epoch starts clean
    assert rec.holdings() == {"ssd": 3} and rec.counts["undescribed"] == 3
    rec.describe(keys[1], hashes[0], tokens[1].tolist())  # a lookup found it: now we can say it
    (event,) = wire(rec.take())
    assert event.medium == STORAGE and event.block_hashes == [kvwire.wire_hash(hashes[1])]
    assert event.token_ids == tokens[1].tolist()
    async with TieredStore(host, [ssd]) as store:
        assert await store.promote(keys[1]) == "ssd"  # into host DRAM: announced there too
        assert [(e.kind, e.medium.medium) for e in rec.take()] == [(Kind.STORED, CPU)]
        assert await store.delete(keys[2])  # never announced: nothing to retract
        assert rec.take() == []
    assert rec.counts["undescribed"] == 1


def test_removal_of_a_block_never_announced_is_silent():
    keys = CHAIN.keys(1)
    rec = EventRecorder(MEDIA)
    rec.stored("host", keys[0])
    rec.removed("host", keys[0], Removal.EVICTED)
    rec.stored("nowhere", keys[0])  # a tier not followed
    assert rec.take() == [] and rec.counts["undescribed"] == 0


def test_pending_events_are_bounded():
    tokens, hashes, keys = CHAIN.links(3)
    rec = EventRecorder(MEDIA, max_pending=2)
    for i in range(3):
        rec.describe(keys[i], None, tokens[i].tolist())
        rec.stored("host", keys[i])
    assert [e.block_hash for e in rec.take()] == [kvwire.wire_hash(h) for h in hashes[1:]]
    assert rec.counts["dropped"] == 1


@pytest.mark.parametrize("stream_of, published", [(lambda key: "a", 1), (lambda key: None, 0)])
def test_a_key_of_no_stream_is_never_published(stream_of, published):
    tokens, _, keys = CHAIN.links(1)
    rec = EventRecorder(MEDIA, stream_of=stream_of)
    rec.describe(keys[0], None, tokens[0].tolist())
    rec.stored("host", keys[0])
    assert len(rec.take()) == published


@pytest.mark.parametrize(
    "flags, error",
    [
        ({"kv_events": "tcp://*:5557"}, "reachable beyond this host"),  # ZMQ authenticates nobody
        ({"kv_events": "tcp://0.0.0.0:5557"}, "reachable beyond this host"),
        ({"kv_events": "udp://x:1"}, "expected tcp://HOST:PORT or ipc://PATH"),
        ({"kv_events_replay": "ipc:///tmp/r"}, "kv_events_replay needs kv_events"),
        ({"kv_events": "ipc:///tmp/e", "kv_events_buffer": "0"}, "kv_events_buffer must be positive"),
    ],
)
def test_event_endpoints_are_checked(flags, error):
    from kvstore.errors import ConfigError
    from kvstore.server.config import ServerConfig

    with pytest.raises(ConfigError, match=error):
        ServerConfig.from_sources(flags, env={})
    if "*" in flags.get("kv_events", ""):
        assert ServerConfig.from_sources({**flags, "insecure": "true"}, env={}).kv_events == flags["kv_events"]


def test_several_tenants_never_share_a_stream():
    from kvstore.errors import ConfigError
    from kvstore.server.kvpublish import stream_specs

    with pytest.raises(ConfigError, match="need '{tenant}'"):
        stream_specs("ipc:///run/ev", None, "", ["a", "b"])
    specs = stream_specs("ipc:///run/{tenant}.ev", "ipc:///run/{tenant}.rp", "kv@{tenant}", ["a", "b"])
    assert {t: (s.endpoint, s.replay, s.topic) for t, s in specs.items()} == {
        "a": ("ipc:///run/a.ev", "ipc:///run/a.rp", "kv@a"),
        "b": ("ipc:///run/b.ev", "ipc:///run/b.rp", "kv@b"),
    }
    assert stream_specs("tcp://127.0.0.1:5557", None, "t", ["only"])["only"].endpoint == "tcp://127.0.0.1:5557"


def test_each_stream_holds_descriptions_within_its_budget():
    """Descriptions count per stream in bytes and entries; a stream beyond its budget first
    loses its own spare descriptions, then is refused; another stream is untouched."""
    from kvstore.store.kvevents import ENTRY_COST, DescriptionRefused

    tokens, _, keys = CHAIN.links(8)
    other = CHAIN.keys(4, seed=1)
    one = ENTRY_COST + 4 * 16
    stream_of = lambda key: "b" if key in keys else "a"  # noqa: E731
    budget = {"b": (3 * one, 100), "a": (100 * one, 2)}
    rec = EventRecorder(MEDIA, stream_of=stream_of, budget=budget.__getitem__)
    for i in range(3):
        rec.stored("host", keys[i])  # held: not spare
        rec.describe(keys[i], None, tokens[i].tolist())
    with pytest.raises(DescriptionRefused) as refused:
        rec.describe(keys[3], None, tokens[3].tolist())
    assert refused.value.what == "described_bytes" and rec.held_bytes["b"] == 3 * one
    rec.describe(other[0], None, tokens[0].tolist())  # a's spare ones: 2 entries
    rec.describe(other[1], None, tokens[1].tolist())
    rec.describe(other[2], None, tokens[2].tolist())  # pushes out a's oldest spare
    assert rec.description(other[0]) is None and rec.description(other[2]) is not None
    rec.stored("host", other[1])
    rec.stored("host", other[2])
    with pytest.raises(DescriptionRefused) as refused:  # none spare left: refused
        rec.describe(other[3], None, tokens[3].tolist())
    assert refused.value.what == "described" and rec.held["a"] == 2
    rec.removed("host", keys[0], Removal.DELETED)  # b's description goes spare...
    rec.describe(keys[3], None, tokens[3].tolist())  # ...and makes room when needed
    assert rec.held["b"] == 3 and rec.description(keys[0]) is None


# --- the positional layout, for decoders written before vLLM's maps --------------------------


class _OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    """A decoder of the positional era (llm-d-kv-cache up to v0.8.1 reads these fields)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _OldCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_OldStored | _OldRemoved | _OldCleared]
    data_parallel_rank: int | None = None


def test_the_array_layout_is_read_by_a_positional_decoder_and_the_map_layout_is_not():
    events = [
        KVEvent(
            Kind.STORED, block_hash=9, parent_hash=4, tokens=np.array([5, 6, 7]), medium=Medium(STORAGE, LOCAL, "ssd")
        ),
        KVEvent(Kind.REMOVED, block_hash=9, medium=Medium(CPU), reason="evicted"),
        KVEvent(Kind.CLEARED),
    ]
    old = msgspec.msgpack.Decoder(type=_OldBatch)
    batch = old.decode(kvwire.encode_batch(events, 2.0, epoch=3, layout=kvwire.EventLayout.ARRAY))
    assert batch.events == [_OldStored([9], 4, [5, 6, 7], 3, None, STORAGE), _OldRemoved([9], CPU), _OldCleared()]
    assert batch.ts == 2.0 and batch.data_parallel_rank == 0
    raw = msgspec.msgpack.decode(kvwire.encode_batch(events, 2.0, epoch=3, layout=kvwire.EventLayout.ARRAY))
    assert raw[3] == 3 and raw[1][1][-1] == "evicted"  # our extensions ride as trailing elements
    with pytest.raises(msgspec.ValidationError):  # what such a decoder makes of today's maps
        old.decode(kvwire.encode_batch(events, 2.0, epoch=3))
