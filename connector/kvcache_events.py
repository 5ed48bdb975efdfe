"""KV events of the connector's tiers, through vLLM's own publisher.  Scheduler side.

When vLLM runs with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", ...}'``, its scheduler publishes its GPU block events and, in the same stream, what
its KV connector hands it (``KVConnectorBase_V1.take_events``, called after every step).
Our tiers' bookkeeping (host pool, SSD, the store process, Redis) lives in this process,
beside vLLM's scheduler, so the events are made here and handed over there; the worker
halves hold no tier state (``get_kv_connector_kv_cache_events`` stays None), and under
tensor parallelism each object is sealed once by this half, so no event needs merging
across workers.  ``KVStoreKVEvents`` (vLLM's ``KVConnectorKVEvents``) carries them.

What is published (``kvstore.store.kvevents``): ``BlockStored`` when an object lands in a
tier (a save committed into host DRAM, a promotion from below, a write-down to SSD, the
store or Redis) and ``BlockRemoved`` when it leaves one, with the reason; one object per
event, its 64-bit wire hash (``kvstore.wire.kv``), its parent's, its tokens, ``block_size`` =
its tokens, ``group_idx`` 0 (one KV cache group), the LoRA's name.  ``medium``: host DRAM
``CPU``; SSD, the store process and Redis ``STORAGE`` with ``locality`` and ``ownership``
(``ssd``, ``kvstore``, ``redis``).  The store process's own evictions are invisible here:
its own stream (``kvstore serve --kv-events``) is the truth for what it holds.  What happens
after the engine's last step (the write-down drained at exit) is not published: vLLM's
publisher stops with the engine; the next engine announces those objects as it finds them.

Tokens come from the scheduler half, which knows them: each hit found and each save planned
is described (``found``, ``saving``).  An SSD object left by an earlier engine process is
announced once a lookup finds it (until then nothing could describe it).  The same
descriptions go to the store process (``Describe``: it only knows keys and bytes), whether
or not vLLM publishes events.

Beyond vLLM (fields its decoders ignore): every event of ours carries ``epoch`` (this
process's start, in ms: an engine restart is a new epoch, whose first event is
``AllBlocksCleared``), and ``BlockRemoved`` its ``reason``.  vLLM builds the batches
itself, so the epoch rides in the events here, not in the batch.

Encoding (``kv_events_encoding``): ``map`` (vLLM's own) or ``array``: our events as
positional arrays (``StoredArray`` and the others: the same structs, ``array_like``), field
for field in vLLM's order, our extensions trailing, for decoders written before vLLM's maps.
vLLM's own GPU block events in the same stream stay in vLLM's encoding (maps): a stream
with both mixes the two, so a positional-only decoder reads ours and fails on vLLM's unless
vLLM's prefix caching publishes none.  ``lookahead_token_ids`` (vLLM 0.33's, for hashes that
take tokens beyond their block) is never set on ours: a chunk hash covers its own tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from connector.plan import SaveJob
from connector.requests import Piece, ReqState
from kvstore.keys import ChunkHash, ObjectKey
from kvstore.store.kvevents import EventRecorder
from kvstore.store.tiered import TieredStore
from kvstore.wire.kv import CPU, LOCAL, REMOTE, STORAGE, EventLayout, Kind, KVEvent, Medium, new_epoch


class StoredEvent(BlockStored, tag="BlockStored"):  # type: ignore[call-arg]  # vLLM's msgspec base, unfollowed
    epoch: int | None = None


class RemovedEvent(BlockRemoved, tag="BlockRemoved"):  # type: ignore[call-arg]  # vLLM's msgspec base, unfollowed
    reason: str | None = None
    epoch: int | None = None


class ClearedEvent(AllBlocksCleared, tag="AllBlocksCleared"):  # type: ignore[call-arg]  # vLLM's msgspec base, unfollowed
    epoch: int | None = None


class StoredArray(StoredEvent, tag="BlockStored", array_like=True):  # type: ignore[call-arg]
    """``StoredEvent`` as a positional array (``kv_events_encoding: array``)."""


class RemovedArray(RemovedEvent, tag="BlockRemoved", array_like=True):  # type: ignore[call-arg]
    """``RemovedEvent`` as a positional array."""


class ClearedArray(ClearedEvent, tag="AllBlocksCleared", array_like=True):  # type: ignore[call-arg]
    """``ClearedEvent`` as a positional array."""


_CLASSES = {
    EventLayout.MAP: (StoredEvent, RemovedEvent, ClearedEvent),
    EventLayout.ARRAY: (StoredArray, RemovedArray, ClearedArray),
}


class KVStoreKVEvents(KVConnectorKVEvents):
    """vLLM's event container, over a plain list (one producer: this half)."""

    def __init__(self, events: Iterable[KVCacheEvent] = ()) -> None:
        self._events = list(events)
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events += events

    def aggregate(self) -> KVStoreKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


def media(store: TieredStore) -> dict[str, Medium]:
    """Each tier of the connector's store in vLLM's terms."""
    out: dict[str, Medium] = {}
    for tier in store.tiers:
        if tier is store.host:
            out[tier.name] = Medium(CPU)
        elif tier.name == "ssd":
            out[tier.name] = Medium(STORAGE, LOCAL, "ssd")
        elif tier.name == "remote":
            shm = getattr(getattr(tier, "client", None), "uses_shm", False)
            out[tier.name] = Medium(STORAGE, LOCAL if shm else REMOTE, "kvstore")
        else:
            out[tier.name] = Medium(STORAGE, REMOTE, tier.name)
    return out


class ConnectorEvents:
    """The scheduler half's event source: describes objects, follows the tiers (when vLLM
    publishes), converts to vLLM's structs."""

    def __init__(
        self,
        store: TieredStore,
        chunk_size: int,
        block_size: int,
        publish: bool,
        encoding: EventLayout = EventLayout.MAP,
    ) -> None:
        self.chunk_size, self.block_size = chunk_size, block_size
        self.classes = _CLASSES[encoding]
        self.epoch = new_epoch()
        self.publish = publish
        self.recorder = EventRecorder(media(store) if publish else {}, group_idx=0)
        if publish:
            self.recorder.attach(store.tiers)
            self.recorder.clear([""])
        for tier in store.lower:
            if hasattr(tier, "describer"):
                tier.describer = self.recorder.description  # the store process learns tokens too

    def found(self, st: ReqState, pieces: list[Piece]) -> None:
        """The request's hit: each object's tokens are the prompt's."""
        for p in pieces:
            self._describe(st, p.key, p.start, p.end)

    def saving(self, st: ReqState, job: SaveJob | None) -> None:
        """Objects a save job will write: chunk ``i`` (or a tail at ``i``) follows hash i-1."""
        if job is None:
            return
        c, bs = self.chunk_size, self.block_size
        for chunk in job.chunks:
            try:
                index = st.hashes.index(ChunkHash(chunk.parent)) + 1 if chunk.parent else 0
            except ValueError:  # a parent this request never hashed: nothing to say
                continue
            pages = chunk.pages or c // bs
            self._describe(st, ObjectKey.from_bytes(chunk.key), index * c, index * c + pages * bs)

    def _describe(self, st: ReqState, key: ObjectKey, start: int, end: int) -> None:
        index = start // self.chunk_size
        parent = st.hashes[index - 1] if index else None
        self.recorder.describe(key, parent, st.view.all_tokens[start:end], st.view.lora or None)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, as vLLM's structs (ours, with the extensions)."""
        return [self._vllm(e) for e in self.recorder.take()] if self.publish else []

    def _vllm(self, e: KVEvent) -> KVCacheEvent:
        m = e.medium or Medium(CPU)
        stored, removed, cleared = self.classes
        if e.kind is Kind.STORED:
            if e.tokens is None:
                raise ValueError(f"KV event of {e.block_hash!r}: a stored block without its tokens")
            tokens = e.tokens.tolist()
            return stored(
                block_hashes=[e.block_hash],
                parent_block_hash=e.parent_hash,
                token_ids=tokens,
                block_size=len(tokens),
                lora_id=None,
                medium=m.medium,
                lora_name=e.lora,
                group_idx=e.group_idx,
                locality=m.locality,
                ownership=m.ownership,
                epoch=self.epoch,
            )
        if e.kind is Kind.REMOVED:
            return removed(
                block_hashes=[e.block_hash],
                medium=m.medium,
                group_idx=e.group_idx,
                locality=m.locality,
                ownership=m.ownership,
                reason=e.reason,
                epoch=self.epoch,
            )
        return cleared(epoch=self.epoch)


def publishes(vllm_config) -> bool:
    """Whether vLLM publishes KV events (``--kv-events-config`` with events enabled)."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and cfg.enable_kv_cache_events and cfg.publisher != "null")


def kv_events_of(vllm_config, cfg, block_size: int) -> Callable[[TieredStore], ConnectorEvents] | None:
    """What builds the scheduler half's event source over its store (``SchedulerHalf``'s
    ``kv_events``): when vLLM publishes, or when a store process wants descriptions (None
    otherwise: nothing to describe for)."""
    publish = publishes(vllm_config)
    if not publish and not cfg.store_target:
        return None
    return lambda store: ConnectorEvents(store, cfg.chunk_size, block_size, publish, cfg.kv_events_encoding)


__all__ = ["ConnectorEvents", "KVStoreKVEvents", "kv_events_of", "media", "publishes"]
