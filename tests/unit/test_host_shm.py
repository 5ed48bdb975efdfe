"""Shared host pools: a second process writes a slot by offset, the owning tier commits and
reads it; file mode, unlink on close, attach errors, and removal of stale pools.

The worker process is real (``sys.executable``); it imports only ``tiers.host_shm``.
"""

import asyncio
import fcntl
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.codec import ObjectGeometry, encode_into, object_size
from kvstore.errors import ConfigError, TierUnavailableError
from kvstore.keys import Identity, chunk_hashes, object_keys
from tiers.host import HostTier, attach_shared, remove_stale_pools
from tiers.host_shm import SHM_DIR

P = 4096
ROOT_DIR = Path(__file__).resolve().parents[2]
NS = Identity("m", "r1", "bf16", "cpu:test", 2, 1, 8).namespace()
DEAD_PID = 2**22 + 12345  # above the largest pid_max Linux allows: never a live process

# Run in the worker: attach, then write the object read from stdin at the offset in argv.
CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from tiers.host_shm import attach_shared
path, size, offset = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pool = attach_shared(path, size, pin=False)
data = np.frombuffer(sys.stdin.buffer.read(), dtype=np.uint8)
pool.array[offset : offset + len(data)] = data
del data
assert pool.close()
"""


def make_obj(key, pages: int = 1) -> np.ndarray:
    geo = ObjectGeometry(2, 2 * pages - 1, 1024)
    buf = np.empty(object_size(geo), np.uint8)
    payload = np.random.default_rng(7).integers(0, 256, geo.payload_bytes, dtype=np.uint8)
    encode_into(buf, key, geo, payload)
    return buf


def keys(n: int) -> list:
    return object_keys(NS, chunk_hashes(NS, np.arange(n * 4), chunk_size=4))


def write_in_child(path: str, size: int, offset: int, data: np.ndarray) -> None:
    subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT_DIR), path, str(size), str(offset)],
        input=data.tobytes(),
        check=True,
        timeout=60,
    )


def shared_tier(pages: int = 8) -> HostTier:
    return HostTier(pages * P, pin=False, shared=True)


def test_a_second_process_fills_a_slot_the_owner_commits_and_reads():
    async def story():
        async with shared_tier() as t:
            a, b = keys(2)
            assert await t.put_start(a, len(make_obj(a))) is not None  # slot 0 taken
            obj = make_obj(b, 2)
            h = await t.put_start(b, len(obj))
            assert h.token.offset == P
            write_in_child(t.shm_path, 8 * P, h.token.offset, obj)
            assert await t.put_commit(h)
            out = np.zeros(len(obj), np.uint8)
            assert await t.read_into(b, out) == len(obj) and np.array_equal(out, obj)

    asyncio.run(story())


def test_pool_file_is_private_allocated_and_removed_on_close():
    t = shared_tier()
    path = t.shm_path
    assert path.startswith(f"{SHM_DIR}/kvstore-pool-{os.getpid()}-")
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 8 * P
    assert st.st_blocks * 512 >= 8 * P  # every page allocated up front: no SIGBUS later
    asyncio.run(t.aclose())
    assert not os.path.exists(path) and t.buffer is None


def test_close_with_a_live_view_unlinks_now_and_keeps_the_view_valid():
    t = shared_tier()
    a, b = keys(2)
    obj = make_obj(a)
    h = t.put_start_sync(a, len(obj))
    h.buffer[:] = obj
    assert t.put_commit_sync(h)
    view = t.acquire(a)
    t.close()
    assert not os.path.exists(t.shm_path)
    assert bytes(view) == obj.tobytes()  # still mapped: the view keeps it alive
    with pytest.raises(TierUnavailableError):
        t.read_into_sync(a, np.zeros(len(obj), np.uint8))
    with pytest.raises(TierUnavailableError):
        t.put_start_sync(b, len(obj))
    t.release(a)


def test_a_worker_mapping_outlives_the_owner_closing():
    t = shared_tier(2)
    t.array[:4] = [1, 2, 3, 4]
    worker = attach_shared(t.shm_path, 2 * P, pin=False)
    t.close()
    assert list(worker.array[:4]) == [1, 2, 3, 4]
    assert worker.close() and worker.array is None


@pytest.mark.parametrize("size", [P, 16 * P])
def test_attach_with_a_wrong_size_names_the_path(size):
    t = shared_tier()
    try:
        with pytest.raises(ConfigError, match=t.shm_path):
            attach_shared(t.shm_path, size, pin=False)
    finally:
        t.close()


def test_attach_to_a_missing_pool_names_the_path():
    path = f"{SHM_DIR}/kvstore-pool-{DEAD_PID}-missing"
    with pytest.raises(ConfigError, match=path):
        attach_shared(path, P, pin=False)


def test_pin_without_cuda_fails_and_leaves_no_file():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: pin=True succeeds")
    before = set(SHM_DIR.glob(f"kvstore-pool-{os.getpid()}-*"))
    with pytest.raises(ConfigError):
        HostTier(4 * P, pin=True, shared=True)
    assert set(SHM_DIR.glob(f"kvstore-pool-{os.getpid()}-*")) == before


def test_stale_pools_of_dead_owners_are_removed_and_live_ones_kept():
    dead = SHM_DIR / f"kvstore-pool-{DEAD_PID}-deadbeef"
    dead_but_locked = SHM_DIR / f"kvstore-pool-{DEAD_PID}-10cced"
    live = SHM_DIR / f"kvstore-pool-{os.getppid()}-a11fe"
    foreign = SHM_DIR / "kvstore-pool-notapid-x"
    for path in (dead, dead_but_locked, live, foreign):
        path.write_bytes(b"x")
    with open(dead_but_locked, "rb") as held:  # a live owner in another pid namespace
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            removed = remove_stale_pools()
            assert str(dead) in removed and str(dead_but_locked) not in removed
            assert not dead.exists() and dead_but_locked.exists()
            assert live.exists() and foreign.exists()
        finally:
            for path in (dead, dead_but_locked, live, foreign):
                path.unlink(missing_ok=True)


def test_creating_a_pool_removes_stale_ones_but_not_other_live_pools():
    dead = SHM_DIR / f"kvstore-pool-{DEAD_PID}-0dd"
    dead.write_bytes(b"x")
    first = shared_tier()
    try:
        second = shared_tier()
        assert not dead.exists() and os.path.exists(first.shm_path)
        assert first.shm_path != second.shm_path
        second.close()
    finally:
        first.close()
        dead.unlink(missing_ok=True)
