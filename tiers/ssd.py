"""SSD tier: one file per object, published by fsync + rename, index rebuilt by scanning.

Runs wherever a local disk is (worker or store-server side) and implements ``tiers.base.Tier``.

Layout::

    <dir>/LOCK                                         flock: one SSDTier per directory
    <dir>/<2 hex of chunk hash>/<key.printable()>.kv   published, whole objects
    <dir>/tmp/<key.printable()>.<pid>.<n>.tmp          puts in progress (removed at start)

Durability: a put writes a temp file, checks its header, fsyncs it, renames it into place and
fsyncs the directory; only then does ``put_commit`` return True.  A crash therefore leaves
either a temp file (removed at the next start) or a whole object; a published name never
points at torn bytes.  The object is readable from the rename on (its bytes are already on
disk); should the directory fsync fail, it is withdrawn again and the put fails.

Start-up scan checks headers only (decodes, names the file's key, length equals the file
size); payload checksums are verified on every read, where a damaged object becomes a
counted miss and is deleted.  Reads land in the caller's buffer (no payload-sized
allocation).  Eviction is prefix-aware: chain tails (no child present) before parents, LRU
first, never an object being read; puts in progress are not in the index, so never evicted.

Concurrency: blocking file I/O runs in worker threads (``asyncio.to_thread``); bookkeeping
lives in ``_Index`` behind one lock that is never held across I/O or an ``await``.  A
cancelled call waits for its worker thread before re-raising, so no thread still writes into
a caller's buffer.  The index entry records the file's inode: removals (eviction, delete,
corruption) unlink a name only while it still holds that inode, never a newer put's file.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import itertools
import logging
import os
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import xxhash

from kvstore import codec
from kvstore.errors import (
    CapacityError, ConfigError, CorruptHeaderError, KeyMismatchError, ObjectFormatError,
    TierError, TierUnavailableError,
)
from kvstore.keys import DIGEST_SIZE, ROOT, ChunkHash, ObjectKey
from tiers.base import PutHandle, TierStats

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TMP = "tmp"
_LOCK = "LOCK"
_WRITE_CHUNK = 4 << 20  # writeback starts per chunk (see _pwrite_all)
_READ_CHUNK = 512 << 10  # hash chunk i while readahead fetches the next (best of 256K-4M here)


@dataclass(slots=True)
class _Entry:
    size: int
    parent: ObjectKey | None
    ino: int  # inode of the published file: removals check it, never deleting a newer put


@dataclass(slots=True)
class _PutState:
    """Tier-private state of one put (``PutHandle.token``)."""

    path: str                        # the temp file
    fd: int = -1
    error: Exception | None = None   # first failure; later writes are skipped
    entry: _Entry | None = None      # set once renamed into place and indexed
    reserved: int = 0                # capacity held for this put until published or failed


class _Read(Enum):
    OK = "ok"
    VANISHED = "vanished"
    CORRUPT = "corrupt"


class _Index:
    """What exists, in LRU order, with child counts, readers and reservations.  No I/O."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[ObjectKey, _Entry] = OrderedDict()  # LRU first
        self.children: Counter[ObjectKey] = Counter()  # present children per parent key
        self.readers: Counter[ObjectKey] = Counter()   # reads in flight per key
        self.used = 0
        self.reserved = 0

    def add(self, key: ObjectKey, entry: _Entry) -> None:
        self.remove(key)
        self.entries[key] = entry
        self.used += entry.size
        if entry.parent is not None:
            self.children[entry.parent] += 1

    def remove(self, key: ObjectKey, only: _Entry | None = None) -> _Entry | None:
        """Drop ``key`` (only if its entry is still ``only``, when given)."""
        entry = self.entries.get(key)
        if entry is None or (only is not None and entry is not only):
            return None
        del self.entries[key]
        self.used -= entry.size
        if entry.parent is not None:
            self.children[entry.parent] -= 1
            if self.children[entry.parent] <= 0:
                del self.children[entry.parent]
        return entry

    def reserve(self, size: int) -> list[tuple[ObjectKey, _Entry]] | None:
        """Reserve ``size`` bytes, evicting as needed; the evicted entries, or None (no room)."""
        excess = self.used + self.reserved + size - self.capacity
        evictable = sum(e.size for k, e in self.entries.items() if not self.readers[k])
        if excess > evictable:
            return None
        victims = []
        while self.used + self.reserved + size > self.capacity:
            key = self._victim()
            victims.append((key, self.remove(key)))
        self.reserved += size
        return victims

    def _victim(self) -> ObjectKey:
        """The LRU chain tail not being read; else the LRU object not being read."""
        fallback = None
        for key in self.entries:
            if self.readers[key]:
                continue
            if not self.children[key]:
                return key
            fallback = key if fallback is None else fallback
        if fallback is None:
            raise RuntimeError("eviction found no victim although enough bytes were evictable")
        return fallback


class SSDTier:
    """A directory of object files with a byte capacity (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, *,
                 fsync: bool = True, name: str = "ssd") -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"SSD tier capacity must be positive, got {capacity_bytes}")
        self.name = name
        self._dir = Path(directory)
        self._fsync = fsync
        self._lock_fd = _claim_directory(self._dir)
        # Serialises renames into place (with their index insert) and removals of published
        # names: worker threads only, held across those metadata syscalls alone.  A removal's
        # inode check + unlink, and a put's rename + index insert, are then atomic with
        # respect to each other and to other puts of the same key.  Taken before _lock.
        self._names = threading.Lock()
        self._seq = itertools.count()
        # Guards _index, _stats, _puts and _closed.  Bookkeeping only: never held across
        # file I/O or an await, so worker threads and the event loop never wait on a disk.
        self._lock = threading.Lock()
        self._index = _Index(capacity_bytes)
        self._stats = TierStats(name, capacity_bytes=capacity_bytes)
        self._puts: dict[int, _PutState] = {}
        self._closed = False
        try:
            self._rebuild()
        except BaseException:
            os.close(self._lock_fd)
            raise

    @classmethod
    async def open(cls, directory: str | os.PathLike, capacity_bytes: int, **kw) -> "SSDTier":
        """Construct (and scan) in a worker thread, off the event loop."""
        return await asyncio.to_thread(cls, directory, capacity_bytes, **kw)

    async def __aenter__(self) -> "SSDTier":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def path_of(self, key: ObjectKey) -> Path:
        return self._dir / _shard(key) / (key.printable() + _SUFFIX)

    def _remove_published(self, key: ObjectKey, ino: int) -> None:
        """Unlink ``key``'s file if it still is inode ``ino`` (not a newer put's file)."""
        path = self.path_of(key)
        with self._names, suppress(FileNotFoundError):
            if os.stat(path).st_ino == ino:
                _unlink_quiet(path)

    # --- start-up scan ------------------------------------------------------------------

    def _rebuild(self) -> None:
        torn = sum(_unlink_quiet(path) for path in (self._dir / _TMP).iterdir())
        corrupt, found = 0, []
        for path in self._dir.glob("??/*" + _SUFFIX):
            item = _scan_file(path)
            if item is None:
                _unlink_quiet(path)
                corrupt += 1
            else:
                found.append(item)
        for _mtime, key, entry in sorted(found, key=lambda item: item[0]):
            self._index.add(key, entry)  # LRU order after a restart: oldest write first
        victims = self._index.reserve(0) or []  # the capacity may have shrunk since last run
        for key, entry in victims:
            self._remove_published(key, entry.ino)
        self._stats.evictions += len(victims)
        self._stats.extra.update(torn_removed=torn, corrupt_removed=corrupt)
        if torn or corrupt:
            log.warning("ssd %s: removed %d torn temp files, %d corrupt objects", self._dir, torn, corrupt)

    # --- index queries ------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ObjectKey]) -> int:
        with self._lock:
            self._check_open()
            n = 0
            while n < len(keys) and keys[n] in self._index.entries:
                n += 1
            return n

    async def contains(self, key: ObjectKey) -> bool:
        return await self.size_of(key) is not None

    async def size_of(self, key: ObjectKey) -> int | None:
        with self._lock:
            self._check_open()
            entry = self._index.entries.get(key)
            return None if entry is None else entry.size

    def stats(self) -> TierStats:
        with self._lock:
            return dataclasses.replace(
                self._stats, objects=len(self._index.entries), bytes_used=self._index.used,
                extra={**self._stats.extra, "reserved_bytes": self._index.reserved})

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
            outcome = await _in_thread(self._read_checked, key, view[: entry.size])
        except OSError as err:
            raise TierError(f"reading {self.path_of(key)} failed: {err}") from err
        finally:
            self._end_read(key, entry, outcome)
        return entry.size if outcome is _Read.OK else None

    def _read_checked(self, key: ObjectKey, view: memoryview) -> _Read:
        outcome, ino = _read_file(self.path_of(key), view, key)
        if outcome is _Read.CORRUPT:
            self._remove_published(key, ino)
        return outcome

    def _begin_read(self, key: ObjectKey, buf_len: int) -> _Entry | None:
        with self._lock:
            self._check_open()
            entry = self._index.entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            if buf_len < entry.size:
                raise ConfigError(f"buffer of {buf_len} bytes cannot hold {key!r} ({entry.size} bytes)")
            self._index.readers[key] += 1  # pins the object against eviction
            self._index.entries.move_to_end(key)
            return entry

    def _end_read(self, key: ObjectKey, entry: _Entry, outcome: _Read | None) -> None:
        with self._lock:
            self._index.readers[key] -= 1
            if self._index.readers[key] <= 0:
                del self._index.readers[key]
            if outcome is _Read.OK:
                self._stats.hits += 1
                self._stats.bytes_read += entry.size
                return
            self._stats.misses += 1
            self._stats.corrupt += outcome is _Read.CORRUPT
            if outcome is not None:
                self._index.remove(key, only=entry)

    # --- two-phase put ------------------------------------------------------------------

    async def put_start(self, key: ObjectKey, size: int, parent: ObjectKey | None = None) -> PutHandle | None:
        if size < codec.HEADER_SIZE:
            raise ConfigError(f"object size {size} is smaller than the {codec.HEADER_SIZE}-byte header")
        if size > self._index.capacity:
            raise CapacityError(f"object of {size} bytes exceeds SSD capacity {self._index.capacity}")
        state = _PutState(str(self._dir / _TMP / f"{key.printable()}.{os.getpid()}.{next(self._seq)}.tmp"))
        handle = PutHandle(key, size, parent, None, state)
        victims = self._reserve(handle)
        if victims is None:
            return None
        try:
            await _in_thread(self._open_temp, state, victims)
        except BaseException as err:
            _discard(state)
            self._finish_put(handle)
            if isinstance(err, OSError):
                raise TierError(f"cannot create {state.path}: {err}") from err
            raise
        return handle

    def _reserve(self, handle: PutHandle) -> list[tuple[ObjectKey, _Entry]] | None:
        with self._lock:
            self._check_open()
            victims = self._index.reserve(handle.size)
            if victims is not None:
                self._stats.evictions += len(victims)
                self._puts[id(handle.token)] = handle.token
                handle.token.reserved = handle.size
            return victims

    def _open_temp(self, state: _PutState, victims: list[tuple[ObjectKey, _Entry]]) -> None:
        for key, entry in victims:  # free the disk space before taking more
            self._remove_published(key, entry.ino)
        state.fd = os.open(state.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    async def put_write(self, handle: PutHandle, offset: int, data: memoryview) -> None:
        """Write at ``offset``.  A write error is remembered and fails the commit."""
        state = self._live_put(handle)
        view = memoryview(data).cast("B")
        if offset < 0 or offset + len(view) > handle.size:
            raise ConfigError(f"write [{offset}, {offset + len(view)}) outside a {handle.size}-byte object")
        if state.error is None:
            await _in_thread(_pwrite_all, state, view, offset, self._fsync)

    async def put_commit(self, handle: PutHandle, ok: bool = True) -> bool:
        state = self._live_put(handle, claim=True)
        try:
            await _in_thread(self._settle, handle, state, ok)
        finally:
            self._finish_put(handle)
        return state.entry is not None

    def _live_put(self, handle: PutHandle, claim: bool = False) -> _PutState:
        """The put's state; ``claim`` takes it out of the pending set (commit owns it now)."""
        state = handle.token
        with self._lock:
            if self._puts.get(id(state)) is not state:
                raise RuntimeError(f"put of {handle.key!r} is not in progress on {self.name!r}")
            if claim:
                del self._puts[id(state)]
            return state

    def _settle(self, handle: PutHandle, state: _PutState, ok: bool) -> None:
        """Publish the object, or remove every trace of it."""
        try:
            if ok and state.error is None:
                self._publish(handle, state)
        except (OSError, ObjectFormatError) as err:
            state.error = err
            self._retract(handle.key, state)
        finally:
            if state.entry is None:
                log.log(logging.WARNING if state.error else logging.DEBUG,
                        "ssd put of %r abandoned: %s", handle.key, state.error or "not ok")
                _discard(state)

    def _publish(self, handle: PutHandle, state: _PutState) -> None:
        header, ino = _check_written(state.fd, handle)
        if self._fsync:
            # Data and size must be on disk BEFORE the name is: otherwise a crash after the
            # rename reached the journal could publish a name over torn or missing bytes.
            os.fsync(state.fd)
        os.close(state.fd)
        state.fd = -1
        parent = handle.parent if handle.parent is not None else _parent_key(handle.key, header.parent)
        final = self.path_of(handle.key)
        new_shard = not final.parent.is_dir()
        final.parent.mkdir(exist_ok=True)
        with self._names:  # rename and index change in one order for all puts of a key
            os.rename(state.path, final)
            state.entry = _Entry(handle.size, parent, ino)
            with self._lock:  # the reservation becomes the entry, atomically
                self._index.add(handle.key, state.entry)
                self._index.reserved -= state.reserved
                state.reserved = 0
        if self._fsync:
            # Make the rename itself durable before reporting success: a committed object
            # must survive a crash.  A new shard's own entry lives in the root directory.
            _fsync_dir(final.parent)
            if new_shard:
                _fsync_dir(self._dir)

    def _retract(self, key: ObjectKey, state: _PutState) -> None:
        """Undo a publish whose directory fsync failed (the object was briefly visible)."""
        if state.entry is not None:
            with self._lock:
                self._index.remove(key, only=state.entry)
            self._remove_published(key, state.entry.ino)
            state.entry = None

    def _finish_put(self, handle: PutHandle) -> None:
        with self._lock:
            self._puts.pop(id(handle.token), None)
            self._index.reserved -= handle.token.reserved
            handle.token.reserved = 0
            if handle.token.entry is None:
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
            await _in_thread(self._remove_published, key, entry.ino)
        return entry is not None

    async def aclose(self) -> None:
        """Close the tier.  Puts still in progress are abandoned (their temp files removed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._puts.values())
            self._puts.clear()
        for state in pending:
            await _in_thread(_discard, state)
        os.close(self._lock_fd)


# --- helpers (blocking; called at construction or in worker threads) -------------------

async def _in_thread(fn, *args):
    """Run blocking I/O in a worker thread.  If the caller is cancelled, wait for the thread
    to finish before re-raising: it may still be touching the caller's buffer or our files."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled():
            task.exception()  # mark retrieved: the caller sees the cancellation
        raise


def _claim_directory(path: Path) -> int:
    """Create ``path`` (+ tmp/), prove it writable, and take its lock; ConfigError if not."""
    try:
        (path / _TMP).mkdir(parents=True, exist_ok=True)
        probe = path / _TMP / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.unlink(probe)
        fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise ConfigError(f"SSD tier directory {path} is not usable: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        raise ConfigError(f"SSD tier directory {path} is in use by another SSDTier") from err
    return fd


def _scan_file(path: Path) -> tuple[float, ObjectKey, _Entry] | None:
    """Mtime, key and index entry of a published file whose header checks out, else None."""
    try:
        key = ObjectKey.parse(path.name[: -len(_SUFFIX)])
        with open(path, "rb", buffering=0) as f:
            head = f.read(codec.HEADER_SIZE)
            st = os.fstat(f.fileno())
        size = st.st_size
        header = codec.decode_header(head)
    except (OSError, ConfigError, ObjectFormatError) as err:
        log.warning("ssd scan: dropping %s: %s", path, err)
        return None
    if header.key != key or header.total_len != size or path.parent.name != _shard(key):
        log.warning("ssd scan: dropping %s: header names another key or length", path)
        return None
    return st.st_mtime, key, _Entry(size, _parent_key(key, header.parent), st.st_ino)


def _read_file(path: Path, view: memoryview, key: ObjectKey) -> tuple[_Read, int]:
    """Read the whole object into ``view`` and verify it; the outcome and the file's inode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Read.VANISHED, 0
    try:
        st = os.fstat(fd)
        if st.st_size != len(view):
            raise CorruptHeaderError(f"file holds {st.st_size} bytes, index says {len(view)}")
        _verify(view, key, _read_hashing(fd, view))
        return _Read.OK, st.st_ino
    except ObjectFormatError as err:
        log.warning("ssd read: %s is damaged (%s); deleting it", path, err)
        return _Read.CORRUPT, st.st_ino
    finally:
        os.close(fd)


def _read_hashing(fd: int, view: memoryview) -> bytes:
    """Fill ``view`` from ``fd`` in chunks, hashing each chunk's payload bytes while the
    kernel's readahead already fetches the next one; the payload's xxh3-128 digest."""
    digest, got = xxhash.xxh3_128(), 0
    while got < len(view):
        n = os.preadv(fd, [view[got : got + _READ_CHUNK]], got)
        if n == 0:
            raise CorruptHeaderError(f"file ended after {got} of {len(view)} bytes")
        digest.update(view[max(got, codec.HEADER_SIZE) : got + n])
        got += n
    return digest.digest()


def _verify(view: memoryview, key: ObjectKey, digest: bytes) -> None:
    """``codec.verify`` without hashing the payload twice: when the streamed digest, key and
    length all match the header, the object is good; otherwise ``codec.verify`` has the
    final word (and raises the precise error)."""
    header = codec.decode_header(view)
    if header.checksum != digest or header.key != key or header.total_len != len(view):
        codec.verify(view, expected_key=key, length=len(view))


def _pwrite_all(state: _PutState, view: memoryview, offset: int, flush_early: bool) -> None:
    """Write ``view`` at ``offset`` in chunks; with ``flush_early`` each chunk's writeback
    starts at once (POSIX_FADV_DONTNEED on dirty pages starts it without waiting, as
    PostgreSQL's pg_flush_data does where sync_file_range is missing): the disk works while
    we write, the final fsync waits for little, and the object does not crowd the page cache."""
    try:
        for start in range(0, len(view), _WRITE_CHUNK):
            chunk, done = view[start : start + _WRITE_CHUNK], 0
            while done < len(chunk):
                done += os.pwrite(state.fd, chunk[done:], offset + start + done)
            if flush_early:
                os.posix_fadvise(state.fd, offset + start, len(chunk), os.POSIX_FADV_DONTNEED)
    except OSError as err:  # e.g. ENOSPC: remembered, the commit fails and cleans up
        state.error = err


def _check_written(fd: int, handle: PutHandle) -> tuple[codec.ObjectHeader, int]:
    """The header of a fully written temp file naming the put's key, and its inode."""
    header = codec.decode_header(os.pread(fd, codec.HEADER_SIZE, 0))
    if header.key != handle.key:
        raise KeyMismatchError(f"object holds {header.key!r}, put names {handle.key!r}")
    st = os.fstat(fd)
    if header.total_len != handle.size or st.st_size != handle.size:
        raise CorruptHeaderError(
            f"put of {handle.size} bytes wrote {st.st_size}, header says {header.total_len}")
    return header, st.st_ino


def _discard(state: _PutState) -> None:
    fd, state.fd = state.fd, -1
    if fd >= 0:
        with suppress(OSError):  # a broken fd (the write error being cleaned up)
            os.close(fd)
    _unlink_quiet(state.path)


def _unlink_quiet(path: str | os.PathLike) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("ssd: cannot remove %s: %s", path, err)
        return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard(key: ObjectKey) -> str:
    return key[DIGEST_SIZE : DIGEST_SIZE + 1].hex()  # first byte (2 hex chars) of the chunk hash


def _parent_key(key: ObjectKey, parent: ChunkHash) -> ObjectKey | None:
    return None if parent == ROOT else ObjectKey(key.namespace, parent, key.tag)


def drop_page_cache(path: str | os.PathLike) -> None:
    """Drop ``path``'s pages from the page cache, for cold-read benchmarks.  fsync first:
    dirty pages are not dropped."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


__all__ = ["SSDTier", "drop_page_cache"]
