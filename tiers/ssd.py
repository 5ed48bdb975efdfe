"""SSD tier: one file per object, published by fsync + rename, index rebuilt by scanning.

Runs wherever a local disk is; ``tiers.base.Tier`` (``contains``, ``present``, ``lookup``: over ``sizes``).

Layout (``tiers.ssd_files``): ``<dir>/LOCK`` (flock: one SSDTier per directory), published
objects in ``<dir>/<2 hex of chunk hash>/<key.printable()>.kv``, puts in progress in ``<dir>/tmp/``.

Durability: a put writes a temp file, checks its header, fsyncs it, renames it into place and
fsyncs the directory; only then does ``put_commit`` return True.  A crash therefore leaves
either a temp file (removed at the next start) or a whole object; a published name never
points at torn bytes.  The object is readable from the rename on (its bytes are already on
disk); should the directory fsync fail, it is withdrawn again and the put fails.

Start-up scan checks headers only (key, length); payload checksums are verified on every
read (a damaged object is a counted miss, deleted).  Reads land in the caller's buffer.
Eviction: chain tails before parents, LRU first, never an object being read or written.

Concurrency: blocking file I/O runs in worker threads (``asyncio.to_thread``); bookkeeping
lives in ``ssd_index.Index`` behind one lock that is never held across I/O or an ``await``.  A
cancelled call waits for its worker thread before re-raising, so no thread still writes into
a caller's buffer.  The index entry records the file's inode: removals (eviction, delete,
corruption) unlink a name only while it still holds that inode, never a newer put's file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, cast

from kvstore import codec
from kvstore.errors import CapacityError, ConfigError, ObjectFormatError, TierError, TierUnavailableError
from kvstore.keys import ObjectKey
from tiers.base import PutHandle, Removal, TierBase, TierStats
from tiers.ssd_files import (
    TMP,
    ReadOutcome,
    check_written,
    claim_directory,
    clear_temp,
    drop_page_cache,
    fsync_dir,
    in_thread,
    object_path,
    own_directory,
    parent_key,
    scan_file,
    scan_objects,
    unlink_quiet,
)
from tiers.ssd_files import read_file as _read_file  # a module global: tests patch it here
from tiers.ssd_index import Entry, Index, Partition
from tiers.ssd_put import PutState, discard, write_part

log = logging.getLogger(__name__)


class SSDTier(TierBase):
    """A directory of object files with a byte capacity (see the module docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        fsync: bool = True,
        name: str = "ssd",
        partition: Partition | None = None,
        quotas: Mapping[str, int] | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"SSD tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._dir = Path(directory)
        self._fsync = fsync
        self._lock_fd = claim_directory(self._dir)
        # Serialises renames into place (with their index insert) and removals of published
        # names: worker threads only, held across those metadata syscalls alone.  A removal's
        # inode check + unlink, and a put's rename + index insert, are then atomic with
        # respect to each other and to other puts of the same key.  Taken before _lock.
        self._names = threading.Lock()
        self._seq = itertools.count()
        # Guards _index, _stats, _puts and _closed.  Bookkeeping only: never held across
        # file I/O or an await, so worker threads and the event loop never wait on a disk.
        self._lock = threading.Lock()
        self._index = Index(capacity_bytes, partition, quotas)
        self._stats = TierStats(name, capacity_bytes=capacity_bytes)
        self._puts: dict[int, PutState] = {}
        self._closed = False
        try:
            self._rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise

    @classmethod
    async def open(cls, directory: str | os.PathLike, capacity_bytes: int, **kw: Any) -> SSDTier:
        """Construct (and scan) in a worker thread, off the event loop."""
        return await asyncio.to_thread(cls, directory, capacity_bytes, **kw)

    def path_of(self, key: ObjectKey) -> Path:
        return object_path(self._dir, key)

    def _remove_published(self, key: ObjectKey, ino: int) -> None:
        """Unlink ``key``'s file if it still is inode ``ino`` (not a newer put's file)."""
        with self._names, suppress(FileNotFoundError):
            if os.stat(path := self.path_of(key)).st_ino == ino:
                unlink_quiet(path)

    # --- start-up scan ------------------------------------------------------------------

    def _rebuild(self) -> None:
        torn = clear_temp(self._dir / TMP)
        corrupt, found = 0, []
        for path in scan_objects(self._dir):
            item = scan_file(path)
            if item is None:
                unlink_quiet(path)
                corrupt += 1
            else:
                found.append(item)
        for _mtime, key, entry in sorted(found, key=lambda item: item[0]):
            self._index.add(key, entry)  # LRU order after a restart: oldest write first
        victims = self._index.trim()  # the capacity or quotas may have shrunk since the last run
        for key, entry in victims:
            self._remove_published(key, entry.ino)
        self._stats.evictions += len(victims)
        self._stats.extra.update(torn_removed=torn, corrupt_removed=corrupt)
        if torn or corrupt:
            log.warning("ssd %s: removed %d torn temp files, %d corrupt objects", self._dir, torn, corrupt)

    # --- index queries ------------------------------------------------------------------

    async def size_of(self, key: ObjectKey) -> int | None:
        with self._lock:
            self._check_open()
            entry = self._index.entries.get(key)
            return None if entry is None else entry.size

    async def sizes(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        """``size_of`` of every key under one lock acquisition (batch lookups)."""
        with self._lock:
            self._check_open()
            get = self._index.entries.get
            return [None if (entry := get(key)) is None else entry.size for key in keys]

    def stats(self) -> TierStats:
        with self._lock:
            return dataclasses.replace(
                self._stats,
                objects=len(self._index.entries),
                bytes_used=self._index.used,
                extra={**self._stats.extra, "reserved_bytes": self._index.reserved},
            )

    def partition_stats(self, part: str) -> dict[str, int]:
        """Objects, bytes used and quota of one partition (see ``tiers.ssd_index``)."""
        with self._lock:
            return self._index.partition_stats(part)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailableError(f"SSD tier {self.name!r} is closed")

    # --- read ---------------------------------------------------------------------------

    async def read_into(self, key: ObjectKey, buf: memoryview) -> int | None:
        view = memoryview(buf).cast("B")
        entry = self._begin_read(key, len(view))
        if entry is None:
            return None
        outcome = None
        try:
            outcome = await in_thread(self._read_checked, key, view[: entry.size])
        except OSError as err:
            raise TierError(f"reading {self.path_of(key)} failed: {err}") from err
        finally:
            self._end_read(key, entry, outcome)
        return entry.size if outcome is ReadOutcome.OK else None

    def _read_checked(self, key: ObjectKey, view: memoryview) -> ReadOutcome:
        outcome, ino = _read_file(self.path_of(key), view, key)
        if outcome is ReadOutcome.CORRUPT:
            self._remove_published(key, ino)
        return outcome

    def _begin_read(self, key: ObjectKey, buf_len: int) -> Entry | None:
        with self._lock:
            self._check_open()
            entry = self._index.entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            if buf_len < entry.size:
                raise ConfigError(f"buffer of {buf_len} bytes cannot hold {key!r} ({entry.size} bytes)")
            self._index.begin_read(key)  # pins the object against eviction
            return entry

    def _end_read(self, key: ObjectKey, entry: Entry, outcome: ReadOutcome | None) -> None:
        with self._lock:
            self._index.end_read(key)
            if outcome is ReadOutcome.OK:
                self._stats.hits += 1
                self._stats.bytes_read += entry.size
                return
            self._stats.misses += 1
            self._stats.corrupt += outcome is ReadOutcome.CORRUPT
            if outcome is not None and self._index.remove(key, only=entry) is not None:
                self._removed(key, Removal.CORRUPT if outcome is ReadOutcome.CORRUPT else Removal.DELETED)

    # --- two-phase put ------------------------------------------------------------------

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self._index.capacity:
            raise CapacityError(f"object of {size} bytes exceeds SSD capacity {self._index.capacity}")
        if size > self._index.quota_of(key) > 0:
            raise CapacityError(f"object of {size} bytes exceeds its SSD partition's quota {self._index.quota_of(key)}")
        state = PutState(str(self._dir / TMP / f"{key.printable()}.{os.getpid()}.{next(self._seq)}.tmp"))
        handle = PutHandle(key, size, parent, None, state)
        victims = self._reserve(handle, state)
        if victims is None:
            return None
        try:
            await in_thread(self._open_temp, state, victims)
        except BaseException as err:
            discard(state)
            self._finish_put(handle)
            if isinstance(err, OSError):
                raise TierError(f"cannot create {state.path}: {err}") from err
            raise
        return handle

    def _reserve(self, handle: PutHandle, state: PutState) -> list[tuple[ObjectKey, Entry]] | None:
        with self._lock:
            self._check_open()
            victims = self._index.reserve(handle.size, handle.key)
            if victims is not None:
                self._stats.evictions += len(victims)
                for key, _entry in victims:
                    self._removed(key, Removal.EVICTED)
                self._puts[id(state)] = state
                state.reserved = handle.size
            return victims

    def _open_temp(self, state: PutState, victims: list[tuple[ObjectKey, Entry]]) -> None:
        for key, entry in victims:  # free the disk space before taking more
            self._remove_published(key, entry.ino)
        state.fd = os.open(state.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        """Write at ``offset``.  A write error is remembered and fails the commit."""
        state = self._live_put(handle)
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > handle.size:
            raise ConfigError(f"write [{offset}, {offset + len(view)}) outside a {handle.size}-byte object")
        if state.error is None:
            await in_thread(write_part, state, view, offset, self._fsync)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        state = self._live_put(handle, claim=True)
        try:
            await in_thread(self._settle, handle, state, ok)
        finally:
            self._finish_put(handle)
        return state.entry is not None

    def _live_put(self, handle: PutHandle, claim: bool = False) -> PutState:
        """The put's state; ``claim`` takes it out of the pending set (commit owns it now)."""
        with self._lock:
            state = self._puts.get(id(handle.token))
            if state is None or state is not handle.token:
                raise RuntimeError(f"put of {handle.key!r} is not in progress on {self.name!r}")
            if claim:
                del self._puts[id(state)]
            return state

    def _settle(self, handle: PutHandle, state: PutState, ok: bool) -> None:
        """Publish the object, or remove every trace of it."""
        try:
            if ok and state.error is None:
                self._publish(handle, state)
        except (OSError, ObjectFormatError) as err:
            state.error = err
            self._retract(handle.key, state)
        finally:
            if state.entry is None:
                log.log(
                    logging.WARNING if state.error else logging.DEBUG,
                    "ssd put of %r abandoned: %s",
                    handle.key,
                    state.error or "not ok",
                )
                discard(state)

    def _publish(self, handle: PutHandle, state: PutState) -> None:
        header, ino = check_written(state.fd, handle)
        if self._fsync:
            # Data and size must be on disk BEFORE the name is: otherwise a crash after the
            # rename reached the journal could publish a name over torn or missing bytes.
            os.fsync(state.fd)
        os.close(state.fd)
        state.fd = -1
        parent = handle.parent if handle.parent is not None else parent_key(handle.key, header.parent)
        final = self.path_of(handle.key)
        new_shard = not os.path.lexists(final.parent)
        if new_shard or not final.parent.is_dir() or final.parent.is_symlink():
            own_directory(final.parent)
        with self._names:  # rename and index change in one order for all puts of a key
            os.rename(state.path, final)
            state.entry = Entry(handle.size, parent, ino)
            with self._lock:  # the reservation becomes the entry, atomically
                self._index.add(handle.key, state.entry)
                self._index.release(state.reserved, handle.key)
                state.reserved = 0
        if self._fsync:
            # Make the rename itself durable before reporting success: a committed object
            # must survive a crash.  A new shard's own entry lives in the root directory.
            fsync_dir(final.parent)
            if new_shard:
                fsync_dir(self._dir)
        self._stored(handle.key)  # durable now: a failed fsync above retracts it unannounced

    def _retract(self, key: ObjectKey, state: PutState) -> None:
        """Undo a publish whose directory fsync failed (the object was briefly visible)."""
        if state.entry is not None:
            with self._lock:
                self._index.remove(key, only=state.entry)
            self._remove_published(key, state.entry.ino)
            state.entry = None

    def _finish_put(self, handle: PutHandle) -> None:
        state = cast(PutState, handle.token)  # this tier's handles carry their PutState
        with self._lock:
            self._puts.pop(id(state), None)
            self._index.release(state.reserved, handle.key)
            state.reserved = 0
            if state.entry is None:
                self._stats.put_failures += 1
            else:
                self._stats.puts += 1
                self._stats.bytes_written += handle.size

    # --- delete / close -----------------------------------------------------------------

    async def delete(self, key: ObjectKey) -> bool:
        with self._lock:
            self._check_open()
            entry = self._index.remove(key)
            if entry is not None:
                self._removed(key, Removal.DELETED)
        if entry is not None:
            await in_thread(self._remove_published, key, entry.ino)
        return entry is not None

    def keys(self) -> list[ObjectKey]:
        """Every object held now (a residency listener attached after the start-up scan
        learns what survived a restart)."""
        with self._lock:
            return list(self._index.entries)

    async def aclose(self) -> None:
        """Close the tier.  Puts still in progress are abandoned (their temp files removed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._puts.values())
            self._puts.clear()
        for state in pending:
            await in_thread(discard, state)
        os.close(self._lock_fd)


__all__ = ["SSDTier", "drop_page_cache"]
