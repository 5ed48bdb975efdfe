"""The connector's KV events in each ``kv_events_encoding``, through vLLM's own publisher.

Proves that the events ``connector.kvcache_events.ConnectorEvents`` hands vLLM, published by
vLLM's real ``ZmqEventPublisher`` and read off a real ZMQ socket, decode with vLLM's own
decoder (``map``) and with a decoder of the positional era (``array``: the structs of
tests/unit/test_kv_events.py), hashes, parents and tokens intact; and that a bad encoding is
refused naming the key.  No engine: a real host tier and vLLM's publisher.  Under vLLM 0.33
(``.venv-vllm033``, a subprocess probe as in tests/integration/test_vllm033_contract.py) our
structs, built on 0.33's ``BlockStored`` (which adds ``lookahead_token_ids``), decode with
0.33's own decoder and leave ``lookahead_token_ids`` None: a chunk hash takes no tokens beyond
its chunk.  Cost: about 2 s, plus about 10 s for the 0.33 probe.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from connector.config import ConnectorConfig
from connector.kvcache_events import ConnectorEvents
from kvstore.errors import ConfigError
from kvstore.store.tiered import TieredStore
from kvstore.wire import kv as kvwire
from kvstore.wire.kv import EventLayout
from tests.unit.test_kv_events import CHAIN, SLOT, _OldBatch, _OldStored, put
from tiers.host import HostTier


async def _events(encoding: EventLayout) -> tuple[list, list]:
    """Two chained objects saved into a real host tier: the connector's events and hashes."""
    tokens, hashes, keys = CHAIN.links(2, seed=3)
    async with TieredStore(HostTier(4 * SLOT, alignment=SLOT), []) as store:
        events = ConnectorEvents(store, 16, 16, publish=True, encoding=encoding)
        for i in range(2):
            parent = hashes[i - 1] if i else None
            events.recorder.describe(keys[i], parent, tokens[i].tolist())
            await put(store, keys[i], parent)
        await store.drain()
        return events.take(), [tokens[i].tolist() for i in range(2)], hashes


def _published(tmp_path, events: list) -> bytes:
    """The payload of one batch of ``events`` as vLLM's ZmqEventPublisher sends it."""
    endpoint = f"ipc://{tmp_path}/events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = ZmqEventPublisher(0, endpoint=endpoint)
    try:
        sub.connect(endpoint)
        deadline = time.monotonic() + 15
        while True:  # a SUB joins late: publish until a batch arrives
            assert time.monotonic() < deadline, "vLLM's publisher sent nothing"
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            if sub.poll(200):
                return sub.recv_multipart()[-1]
    finally:
        publisher.shutdown()
        sub.close(0)
        ctx.destroy(0)


def test_map_encoding_is_read_by_vllms_decoder(tmp_path):
    events, tokens, hashes = asyncio.run(_events(EventLayout.MAP))
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(_published(tmp_path, events))
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[kvwire.wire_hash(h)] for h in hashes]
    assert [e.token_ids for e in stored] == tokens
    assert stored[1].parent_block_hash == kvwire.wire_hash(hashes[0])
    with pytest.raises(msgspec.ValidationError):  # maps are not what a positional decoder reads
        msgspec.msgpack.Decoder(type=_OldBatch).decode(_published(tmp_path, events))


def test_array_encoding_is_read_by_a_positional_decoder(tmp_path):
    events, tokens, hashes = asyncio.run(_events(EventLayout.ARRAY))
    batch = msgspec.msgpack.Decoder(type=_OldBatch).decode(_published(tmp_path, events))
    stored = [e for e in batch.events if isinstance(e, _OldStored)]
    assert len(batch.events) == 3  # AllBlocksCleared (a new epoch), then the two stored
    assert [e.block_hashes for e in stored] == [[kvwire.wire_hash(h)] for h in hashes]
    assert [e.token_ids for e in stored] == tokens
    assert stored[1].parent_block_hash == kvwire.wire_hash(hashes[0]) and {e.medium for e in stored} == {"CPU"}


def test_the_encoding_key_is_checked():
    cfg = ConnectorConfig.from_extra_config({"kv_events_encoding": "array"}, {})
    assert cfg.kv_events_encoding is EventLayout.ARRAY
    with pytest.raises(ConfigError, match=r"kv_events_encoding.*'positional'.*map, array"):
        ConnectorConfig.from_extra_config({"kv_events_encoding": "positional"}, {})


_PROBE = """
import json, msgspec
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from connector.kvcache_events import StoredArray, StoredEvent
def ev(cls):
    return cls(block_hashes=[7], parent_block_hash=3, token_ids=[1, 2], block_size=2, lora_id=None,
               medium="CPU", lora_name=None, epoch=11)
enc = msgspec.msgpack.Encoder()
m = msgspec.msgpack.Decoder(type=KVEventBatch).decode(enc.encode(KVEventBatch(ts=1.0, events=[ev(StoredEvent)])))
raw = msgspec.msgpack.decode(enc.encode(KVEventBatch(ts=1.0, events=[ev(StoredArray)])))
print(json.dumps({"has_lookahead": "lookahead_token_ids" in BlockStored.__struct_fields__,
                  "map": [type(m.events[0]).__name__, m.events[0].token_ids, m.events[0].lookahead_token_ids],
                  "array": raw[1][0]}))
"""


def test_vllm033_decodes_our_events_without_lookahead_tokens():
    root = Path(__file__).resolve().parents[2]
    python = root / ".venv-vllm033" / "bin" / "python"
    assert python.exists(), f"{python} is missing: run `make vllm033` (make test does)"
    proc = subprocess.run(
        [str(python), "-c", _PROBE],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["has_lookahead"]  # it really is 0.33's struct
    assert report["map"] == ["BlockStored", [1, 2], None]
    positional = report["array"]
    assert positional[:7] == ["BlockStored", [7], 3, [1, 2], 2, None, "CPU"] and positional[-1] == 11
