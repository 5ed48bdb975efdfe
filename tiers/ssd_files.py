"""Blocking file helpers of the SSD tier (``tiers.ssd``): the directory layout, claiming a
directory, the start-up scan, verified reads and chunked writes.

Everything here blocks: the tier calls it at construction or in worker threads, never on
the event loop and never under its bookkeeping lock.  No state: what exists lives in
``tiers.ssd_index``.

Files are 0600 and the tier's directories 0700 (objects hold tenants' KV bytes).  Nothing
here follows a symlink: a symlink where the tier expects its own directory or file is
removed (the link, never its target) with a warning, files are opened ``O_NOFOLLOW``, and
the start-up scan walks entries without following links (``scan_objects``).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import xxhash

from kvstore import codec
from kvstore.errors import ConfigError, CorruptHeaderError, KeyMismatchError, ObjectFormatError
from kvstore.keys import DIGEST_SIZE, ROOT, ChunkHash, ObjectKey
from tiers.base import PutHandle
from tiers.ssd_index import Entry

log = logging.getLogger("tiers.ssd")  # the tier's logger: one name for all its messages

SUFFIX = ".kv"
TMP = "tmp"
LOCK = "LOCK"
_WRITE_CHUNK = 4 << 20  # writeback starts per chunk (see pwrite_all)
_READ_CHUNK = 512 << 10  # hash chunk i while readahead fetches the next (best of 256K-4M here)


class ReadOutcome(Enum):
    OK = "ok"
    VANISHED = "vanished"
    CORRUPT = "corrupt"


def object_path(root: Path, key: ObjectKey) -> Path:
    return root / _shard(key) / (key.printable() + SUFFIX)


def claim_directory(path: Path) -> int:
    """Create ``path`` (+ tmp/), prove it writable, and take its lock; ConfigError if not."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_root(path)
        own_directory(path / TMP)
        probe = path / TMP / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
        os.unlink(probe)
        fd = _open_lock(path / LOCK)
    except OSError as err:
        raise ConfigError(f"SSD tier directory {path} is not usable: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        raise ConfigError(f"SSD tier directory {path} is in use by another SSDTier") from err
    return fd


def _check_root(path: Path) -> None:
    """The tier's root must be this user's own directory, closed to others: whoever else can
    write it can replace an object file (its checksum is theirs to compute).  Another
    owner is refused; group or other permission bits are taken away, loudly."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"SSD tier directory {path} is not a directory (a symlink or a file is refused)")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"SSD tier directory {path} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.geteuid()}: its owner could replace the objects in it; give the store a "
            "directory of its own (mode 0700)"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning(
            "ssd: %s had mode %o: other users could read or replace its objects; it is now 0700",
            path,
            stat.S_IMODE(st.st_mode),
        )
        os.chmod(path, 0o700)


def own_directory(path: Path) -> None:
    """Make ``path`` a real directory of mode 0700 (a symlink there is removed, not followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        path.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        log.warning("ssd: %s is a symlink; removing the link (not its target) and making a directory", path)
        os.unlink(path)
        path.mkdir(mode=0o700)
    elif stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def _open_lock(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        if not os.path.islink(path):
            raise
        log.warning("ssd: %s is a symlink; removing the link (not its target)", path)
        os.unlink(path)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def scan_objects(root: Path) -> Iterator[Path]:
    """Every published object file (``??/*.kv``) without following a symlink: a symlinked
    shard or object is removed (the link only), with a warning."""
    with os.scandir(root) as shards:
        for shard in shards:
            if len(shard.name) != 2 or shard.name == TMP:
                continue
            if shard.is_symlink():
                log.warning("ssd scan: removing symlink %s (not its target)", shard.path)
                unlink_quiet(shard.path)
                continue
            if not shard.is_dir(follow_symlinks=False):
                continue
            if stat.S_IMODE(shard.stat(follow_symlinks=False).st_mode) != 0o700:
                os.chmod(shard.path, 0o700)
            yield from _shard_objects(Path(shard.path))


def _shard_objects(shard: Path) -> Iterator[Path]:
    with os.scandir(shard) as entries:
        for entry in entries:
            if not entry.name.endswith(SUFFIX):
                continue
            if entry.is_symlink():
                log.warning("ssd scan: removing symlink %s (not its target)", entry.path)
                unlink_quiet(entry.path)
            elif entry.is_file(follow_symlinks=False):
                yield Path(entry.path)


def clear_temp(tmp: Path) -> int:
    """Remove what a crash left in ``tmp`` (entries are unlinked, links never followed)."""
    with os.scandir(tmp) as entries:
        return sum(unlink_quiet(entry.path) for entry in entries)


def scan_file(path: Path) -> tuple[float, ObjectKey, Entry] | None:
    """Mtime, key and index entry of a published file whose header checks out, else None."""
    try:
        key = ObjectKey.parse(path.name[: -len(SUFFIX)])
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            head = os.pread(fd, codec.HEADER_SIZE, 0)
            st = os.fstat(fd)
            if stat.S_IMODE(st.st_mode) != 0o600:
                os.fchmod(fd, 0o600)  # written by an older version: 0644
        finally:
            os.close(fd)
        size = st.st_size
        header = codec.decode_header(head)
    except (OSError, ConfigError, ObjectFormatError) as err:
        log.warning("ssd scan: dropping %s: %s", path, err)
        return None
    if header.key != key or header.total_len != size or path.parent.name != _shard(key):
        log.warning("ssd scan: dropping %s: header names another key or length", path)
        return None
    return st.st_mtime, key, Entry(size, parent_key(key, header.parent), st.st_ino)


def read_file(path: Path, view: memoryview, key: ObjectKey) -> tuple[ReadOutcome, int]:
    """Read the whole object into ``view`` and verify it; the outcome and the file's inode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return ReadOutcome.VANISHED, 0
    try:
        st = os.fstat(fd)
        if st.st_size != len(view):
            raise CorruptHeaderError(f"file holds {st.st_size} bytes, index says {len(view)}")
        _verify(view, key, _read_hashing(fd, view))
        return ReadOutcome.OK, st.st_ino
    except ObjectFormatError as err:
        log.warning("ssd read: %s is damaged (%s); deleting it", path, err)
        return ReadOutcome.CORRUPT, st.st_ino
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


def pwrite_all(fd: int, view: memoryview, offset: int, flush_early: bool) -> None:
    """Write ``view`` at ``offset`` in chunks; with ``flush_early`` each chunk's writeback
    starts at once (POSIX_FADV_DONTNEED on dirty pages starts it without waiting, as
    PostgreSQL's pg_flush_data does where sync_file_range is missing): the disk works while
    we write, the final fsync waits for little, and the object does not crowd the page cache."""
    for start in range(0, len(view), _WRITE_CHUNK):
        chunk, done = view[start : start + _WRITE_CHUNK], 0
        while done < len(chunk):
            done += os.pwrite(fd, chunk[done:], offset + start + done)
        if flush_early:
            os.posix_fadvise(fd, offset + start, len(chunk), os.POSIX_FADV_DONTNEED)


def check_written(fd: int, handle: PutHandle) -> tuple[codec.ObjectHeader, int]:
    """The header of a fully written temp file naming the put's key, and its inode."""
    header = codec.decode_header(os.pread(fd, codec.HEADER_SIZE, 0))
    if header.key != handle.key:
        raise KeyMismatchError(f"object holds {header.key!r}, put names {handle.key!r}")
    st = os.fstat(fd)
    if header.total_len != handle.size or st.st_size != handle.size:
        raise CorruptHeaderError(f"put of {handle.size} bytes wrote {st.st_size}, header says {header.total_len}")
    return header, st.st_ino


_T = TypeVar("_T")
_Args = TypeVarTuple("_Args")


async def in_thread(fn: Callable[[*_Args], _T], *args: *_Args) -> _T:
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


def unlink_quiet(path: str | os.PathLike) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as err:
        log.warning("ssd: cannot remove %s: %s", path, err)
        return False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shard(key: ObjectKey) -> str:
    return key[DIGEST_SIZE : DIGEST_SIZE + 1].hex()  # first byte (2 hex chars) of the chunk hash


def parent_key(key: ObjectKey, parent: ChunkHash) -> ObjectKey | None:
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
