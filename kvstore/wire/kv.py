"""KV events on the wire, in vLLM's format (``vllm.distributed.kv_events``), which KV-aware
routers already consume (llm-d's precise prefix scorer, Dynamo's router).

Used by the store process's publisher (``kvstore.server.kvpublish``) and by tests; the
connector hands the same events to vLLM's own publisher as vLLM's structs
(``connector.kvcache_events``).  No I/O here.

A message is three ZMQ frames: the topic, an 8-byte big-endian sequence number, and a
msgpack *batch* ``[ts, [event, ...], data_parallel_rank, epoch]``.  Each event is a map
tagged with ``type``, field for field as vLLM's msgspec structs encode it:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids`` (always: routers
  re-derive their own hashes from them), ``block_size``, ``lora_id``, ``medium``,
  ``lora_name``, then, when set, ``group_idx``, ``locality`` and ``ownership``;
* ``BlockRemoved``: ``block_hashes``, ``medium`` (and ``group_idx``, ``locality``,
  ``ownership`` when set);
* ``AllBlocksCleared``.

One event describes one object: a full chunk (``block_size`` = its tokens, 256 by default)
or a tail of whole engine blocks (``block_size`` = its tokens).  **Wire hashes** are 64-bit,
as vLLM's are: the low 64 bits (last 8 bytes, big-endian) of the object's 32-byte chunk
hash, exactly how vLLM shortens its own (``maybe_convert_block_hash``); the full keys stay
internal.  ``medium`` is ``CPU`` for host DRAM and ``STORAGE`` for the SSD directory, Redis
and the store process, with ``locality`` (``LOCAL``/``REMOTE``) and ``ownership`` (the tier's
name) saying which.

**Beyond vLLM** (decoders that do not know them ignore them: msgspec skips unknown map
fields and trailing array elements):

* ``epoch``: the publisher's restart epoch, the 4th element of every batch (milliseconds of
  the wall clock when the publisher started: it grows across restarts).  A batch of a new
  epoch starts with ``AllBlocksCleared``: what an older epoch announced is void.
* ``reason`` on ``BlockRemoved``: ``evicted``, ``expired``, ``corrupt`` or ``deleted``.

**Layouts** (``EventLayout``): ``map`` (the default, above: vLLM since its PR #42892) or
``array``, each event a positional array ``[tag, field, field, ...]`` in the same field
order, for the decoders written before maps (llm-d-kv-cache up to v0.8.1, older Dynamo,
AIBrix and kthena): ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, ...]``, ``["BlockRemoved", block_hashes, medium,
...]``, ``["AllBlocksCleared"]``.  Fields a decoder does not know are trailing elements,
which array decoders skip, as map decoders skip unknown keys.
"""

from __future__ import annotations

import functools
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kvstore.keys import ChunkHash

CPU, STORAGE = "CPU", "STORAGE"
LOCAL, REMOTE = "LOCAL", "REMOTE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker (vLLM's)


class EventLayout(Enum):
    """How each event is encoded (module docstring)."""

    MAP = "map"
    ARRAY = "array"


class Kind(Enum):
    STORED = "BlockStored"
    REMOVED = "BlockRemoved"
    CLEARED = "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class Medium:
    """Where a tier keeps its objects, in vLLM's terms."""

    medium: str  # CPU | STORAGE
    locality: str | None = None  # LOCAL | REMOTE, relative to the publisher
    ownership: str | None = None  # which tier (None: the publisher's primary CPU pool)


@dataclass(frozen=True, slots=True)
class Description:
    """What a router needs to know of an object beyond its key: its parent in the chain,
    its tokens and its LoRA.  Tokens are kept as 32-bit integers (4 bytes each)."""

    parent: ChunkHash | None
    tokens: array
    lora: str | None = None

    @classmethod
    def of(cls, parent: ChunkHash | None, tokens: Sequence[int], lora: str | None = None) -> Description:
        return cls(parent, array("I", tokens), lora or None)


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One event of one stream (a tenant, or "" for a publisher with one stream)."""

    kind: Kind
    stream: str | None = ""  # None: a key of no configured tenant (EventRecorder's stream_of)
    medium: Medium | None = None
    block_hash: int = 0
    parent_hash: int | None = None
    tokens: array | None = None
    lora: str | None = None
    reason: str | None = None
    group_idx: int | None = None


def wire_hash(chunk_hash: bytes) -> int:
    """The 64-bit wire hash of a 32-byte chunk hash (its low 64 bits)."""
    return int.from_bytes(chunk_hash[-8:], "big")


def new_epoch() -> int:
    """A restart epoch: milliseconds of the wall clock now."""
    return time.time_ns() // 1_000_000


@functools.cache
def _structs(layout: EventLayout = EventLayout.MAP):
    """msgspec structs mirroring vLLM's (same tags, fields and order), plus our extensions,
    as maps or positional arrays; built on first use so that importing this module needs no
    msgspec."""
    import msgspec

    array = layout is EventLayout.ARRAY

    class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False, array_like=array):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False, array_like=array):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None
        reason: str | None = None  # ours

    class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False, array_like=array):
        pass

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None
        epoch: int | None = None  # ours

    return BlockStored, BlockRemoved, AllBlocksCleared, Batch, msgspec.msgpack.Encoder()


def _struct(event: KVEvent, layout: EventLayout = EventLayout.MAP):
    stored, removed, cleared, _, _ = _structs(layout)
    m = event.medium or Medium(CPU)
    if event.kind is Kind.STORED:
        tokens = event.tokens.tolist() if event.tokens is not None else []
        return stored(
            [event.block_hash],
            event.parent_hash,
            tokens,
            len(tokens),
            None,
            m.medium,
            event.lora,
            group_idx=event.group_idx,
            locality=m.locality,
            ownership=m.ownership,
        )
    if event.kind is Kind.REMOVED:
        return removed(
            [event.block_hash],
            m.medium,
            group_idx=event.group_idx,
            locality=m.locality,
            ownership=m.ownership,
            reason=event.reason,
        )
    return cleared()


def encode_batch(
    events: Sequence[KVEvent], ts: float, epoch: int, dp_rank: int = 0, layout: EventLayout = EventLayout.MAP
) -> bytes:
    """The msgpack payload of one batch (the third frame of a message)."""
    *_, batch, encoder = _structs(layout)
    return encoder.encode(batch(ts, [_struct(e, layout) for e in events], dp_rank, epoch))


__all__ = [
    "CPU",
    "END_SEQ",
    "LOCAL",
    "REMOTE",
    "STORAGE",
    "Description",
    "EventLayout",
    "KVEvent",
    "Kind",
    "Medium",
    "encode_batch",
    "new_epoch",
    "wire_hash",
]
