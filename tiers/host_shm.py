"""Host pool memory shared between processes: a file in /dev/shm mapped by name (the
connector's two processes), or a memfd handed over as a descriptor (the store process).

The vLLM connector runs in two processes.  The scheduler side owns the ``HostTier`` (index,
allocator, leases) and creates its pool with ``HostTier(..., shared=True)``; the worker side
maps the same bytes with ``attach_shared(tier.shm_path, capacity)`` and reads and writes
slots by offset.  Bookkeeping stays with the owner; this module only maps memory.

* **Files** are ``/dev/shm/kvstore-pool-<pid>-<hex>``, mode 0600, sized with ``ftruncate``
  and fully allocated at creation (``posix_fallocate``: a /dev/shm too small for the pool
  fails here with ``ConfigError`` instead of a SIGBUS at the first touch of a missing
  page), then prefaulted so later copies run at memcpy speed.
* **Lifetime.**  The owner unlinks the file when it closes (or is collected, or exits);
  mappings made before stay valid, and the memory is freed when the last one goes.
  ``mmap.close()`` refuses while numpy arrays or memoryviews of the mapping are alive
  (``BufferError``): ``close()`` then drops its own references, leaves the unmap to the
  garbage collection of the last view, and returns False.
* **Stale files** of crashed owners are removed by ``remove_stale_pools`` (called whenever
  a pool is created).  A file goes only if its pid is dead *and* no process holds the flock
  its owner keeps for the pool's lifetime: a pid seen through a /dev/shm shared with
  another pid namespace is not trusted alone.
* **memfd pools** (``create_memfd``, the store process's tenant pools): anonymous memory with
  no name anywhere, so no other process can open it by name; it reaches a client only as a
  descriptor (``kvstore.server.shmgate``).  Sealed against shrinking and growing (a client
  cannot truncate it under the server, which would turn the server's next touch into a
  SIGBUS), mode 0600; ``seal_writes`` adds ``F_SEAL_FUTURE_WRITE``, after which nobody can
  map it writable again (the owner's mapping stays writable).  ``readonly_fd`` reopens a
  read-only descriptor for readers; ``map_fd`` is the client's side.
* **Stale files** whose name looks like ours but that we cannot inspect or remove (planted
  by another user, say) are skipped with a warning, never an error.
* **Pinning** (``cudaHostRegister``) is per process, and makes that process create a CUDA
  context: pin where the GPU copies run (the worker), not in a CPU-only scheduler.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvstore.errors import ConfigError, TierError

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
_PREFIX = "kvstore-pool-"
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # Linux >= 5.1
log = logging.getLogger("tiers.host")


class SharedPoolView:
    """A read-write mapping of one pool file: ``array`` (numpy uint8), ``buffer`` (its
    memoryview), ``tensor`` (a torch view when pinned, else None) and ``path``."""

    def __init__(self, path: str, fd: int, size: int, pin: bool | None, writable: bool = True) -> None:
        self.path = path
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, prot=prot)  # MAP_SHARED
        self.array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)
        self.buffer: memoryview | None = memoryview(self.array)
        self.tensor = _pin(self.array, pin)
        self.writable = writable

    def close(self) -> bool:
        """Unmap.  False when views of the mapping are still alive: it is then unmapped
        when the last of them is garbage-collected."""
        if self._mmap is None:
            return True
        if self.tensor is not None:
            _unpin(self.array)
        mm, self._mmap = self._mmap, None
        self.array = self.buffer = self.tensor = None
        try:
            mm.close()
        except BufferError:
            return False
        return True


class _OwnedPool(SharedPoolView):
    """The creator's mapping: holds the file's flock and unlinks the file on close."""

    def __init__(self, path: str, fd: int, size: int, pin: bool | None) -> None:
        super().__init__(path, fd, size, pin)
        # Unlinks the file and drops the flock: at close(), or when the view is collected
        # or the interpreter exits without a close.
        self._release_file = weakref.finalize(self, _release_file, path, fd)

    def close(self) -> bool:
        try:
            return super().close()
        finally:
            self._release_file()


class MemfdPool(SharedPoolView):
    """The owner's mapping of a memfd pool (see the module docstring); ``fd`` stays open
    until ``close`` so it can be handed to clients."""

    def __init__(self, name: str, fd: int, size: int) -> None:
        super().__init__(f"memfd:{name}", fd, size, pin=False)
        self.fd, self.size = fd, size
        self._release_fd = weakref.finalize(self, os.close, fd)

    def seal_writes(self) -> None:
        """No new writable mapping of this pool, by anyone (ours stays writable)."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)

    def readonly_fd(self) -> int:
        """A new read-only descriptor of the pool (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> bool:
        try:
            return super().close()
        finally:
            self._release_fd()


def create_memfd(size: int, name: str) -> MemfdPool:
    """A new, prefaulted, resize-sealed memfd pool of ``size`` bytes (the owner's side)."""
    try:
        fd = os.memfd_create(f"kvstore-{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as err:
        raise ConfigError(f"cannot create a memfd pool for {name!r}: {err.strerror or err}") from err
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        pool = MemfdPool(name, fd, size)
    except BaseException as err:
        os.close(fd)
        if isinstance(err, OSError):
            raise ConfigError(f"cannot allocate {size} bytes for memfd pool {name!r}: {err.strerror or err}") from err
        raise
    assert pool.array is not None  # a fresh mapping is open
    pool.array.fill(0)  # fault every page in now (and fail here, not later, when memory is short)
    return pool


def write_sealed(fd: int) -> bool:
    """Whether the file behind ``fd`` refuses every new writable mapping and write
    (``F_SEAL_FUTURE_WRITE`` or ``F_SEAL_WRITE``): asked of the file itself, so a client
    need not take the server's word for it."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return bool(seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE))


def map_fd(fd: int, size: int, writable: bool) -> SharedPoolView:
    """Map a pool received as a descriptor (the client's side); ``ConfigError`` when it is
    not ``size`` bytes long or cannot be mapped so."""
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ConfigError(f"shared pool descriptor holds {actual} bytes, expected {size}")
        return SharedPoolView(f"fd:{fd}", fd, size, pin=False, writable=writable)
    except OSError as err:
        raise ConfigError(
            f"cannot map the shared pool ({'read-write' if writable else 'read-only'}): {err.strerror or err}"
        ) from err


def create_shared(size: int, *, pin: bool | None = None) -> SharedPoolView:
    """A new, prefaulted pool file of ``size`` bytes mapped read-write (the owner's side)."""
    remove_stale_pools()
    path = str(SHM_DIR / f"{_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ConfigError(f"cannot create shared pool {path}: {err.strerror or err}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while the owner lives: the file is in use
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        pool = _OwnedPool(path, fd, size, pin)
    except BaseException as err:
        _release_file(path, fd)
        if isinstance(err, OSError):
            raise ConfigError(f"cannot allocate {size} bytes for shared pool {path}: {err.strerror or err}") from err
        raise
    assert pool.array is not None  # a fresh mapping is open
    pool.array.fill(0)  # fault every page in now
    return pool


def attach_shared(path: str, size: int, *, pin: bool | None = None) -> SharedPoolView:
    """Map an existing pool read-write (the worker's side); ``ConfigError`` naming the path
    when it is missing or not ``size`` bytes long."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as err:
        raise ConfigError(f"cannot attach shared pool {path}: {err.strerror or err}") from err
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ConfigError(f"shared pool {path} holds {actual} bytes, expected {size}")
        return SharedPoolView(path, fd, size, pin)
    finally:
        os.close(fd)  # the mapping outlives the descriptor


def remove_stale_pools() -> list[str]:
    """Delete the pool files of owners that are gone; the paths removed."""
    removed = []
    for path in SHM_DIR.glob(_PREFIX + "*"):
        pid = _owner_pid(path.name)
        if pid is None or _alive(pid) or _in_use(path):
            continue
        if _unlink_quiet(str(path)):
            removed.append(str(path))
    return removed


# --- helpers --------------------------------------------------------------------------


def _owner_pid(name: str) -> int | None:
    """The pid in ``kvstore-pool-<pid>-<hex>``; None for a name we did not make."""
    pid, sep, _ = name[len(_PREFIX) :].partition("-")
    return int(pid) if sep and pid.isascii() and pid.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or a pid no process can have
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _in_use(path: Path) -> bool:
    """Whether some process holds the file's flock (or we cannot tell)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as err:  # unreadable, a symlink, ...: not ours to judge
        log.warning("shared pool: skipping stale %s: cannot inspect it (%s)", path, err.strerror or err)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _release_file(path: str, fd: int) -> None:
    _unlink_quiet(path)
    os.close(fd)


def _unlink_quiet(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as err:  # not ours to remove (another user's file in sticky /dev/shm)
        log.warning("shared pool: skipping stale %s: cannot remove it (%s)", path, err.strerror or err)
        return False


def _pin(array: np.ndarray, pin: bool | None) -> torch.Tensor | None:
    """Page-lock the mapping for CUDA DMA in this process; a torch view of it, or None."""
    if pin is False:
        return None
    import torch  # lazily: only the CUDA probe and the pinned path need it

    if not torch.cuda.is_available():
        if pin:
            raise ConfigError("pin=True needs CUDA: pinned host memory is a CUDA-only path")
        return None
    err = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    if int(err) != 0:
        raise TierError(f"cudaHostRegister of {array.nbytes} shared bytes failed: {err}")
    return torch.from_numpy(array)


def _unpin(array: np.ndarray) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)


__all__ = [
    "F_SEAL_FUTURE_WRITE",
    "MemfdPool",
    "SHM_DIR",
    "SharedPoolView",
    "attach_shared",
    "create_memfd",
    "create_shared",
    "map_fd",
    "remove_stale_pools",
    "write_sealed",
]
