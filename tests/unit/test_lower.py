"""Writing saved chunks down to the lower tiers (``connector.lower.WriteDown``) and the
batched presence lookup of ``TieredStore``, on a real host pool and a real SSD directory."""
from __future__ import annotations

import numpy as np
import pytest

from connector.config import ConnectorConfig
from connector.ioloop import IOLoop
from connector.lower import DIRTY_FRACTION, WriteDown, open_lower_tiers
from kvstore.config import WritePolicy
from kvstore.errors import TierUnavailableError
from kvstore.keys import Identity, chunk_hashes, object_keys
from kvstore.testing.redis_proc import free_port
from kvstore.store.tiered import TieredStore
from tiers.host import HostTier
from tiers.ssd import SSDTier

from test_host_tier import P, make_obj  # noqa: E402 - shared object maker

NS = Identity("m", "r1", "bf16", "cpu:test", 2, 1, 8).namespace()


def keys(n: int, seed: int = 0):
    return object_keys(NS, chunk_hashes(NS, np.arange(n * 4) + seed * 100_000, chunk_size=4))


class Rig:
    """A host pool of ``pages`` 4 KiB units over an SSD directory, plus the I/O loop."""

    def __init__(self, tmp_path, policy: str, pages: int = 16, ssd_capacity: int = 1 << 20) -> None:
        self.io = IOLoop()
        self.host = HostTier(pages * P, pin=False)
        self.ssd = SSDTier(tmp_path / "ssd", ssd_capacity)
        self.failures: list[tuple[str, str]] = []
        self.bytes: list[tuple[str, str, int]] = []
        self.writer = WriteDown(self.host, [self.ssd], self.io, WritePolicy(policy),
                                lambda *a: self.bytes.append(a), lambda *a: self.failures.append(a))

    def commit(self, key, parent=None) -> None:
        obj = make_obj(key, 1)
        handle = self.host.put_start_sync(key, len(obj), parent)
        assert handle is not None
        handle.buffer[:] = obj
        assert self.host.put_commit_sync(handle)
        self.writer.committed(key, parent)

    def on_ssd(self, ks) -> list[bool]:
        return [self.io.run(self.ssd.contains(k)) for k in ks]

    def close(self) -> None:
        self.io.run(self.ssd.aclose())
        self.host.close()
        self.io.close()


@pytest.fixture
def rig_factory(tmp_path):
    rigs = []

    def make(policy: str, **kw) -> Rig:
        rigs.append(Rig(tmp_path / str(len(rigs)), policy, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def test_write_through_copies_each_commit_and_releases_the_slot(rig_factory):
    r = rig_factory("write_through")
    ks = keys(3)
    for i, k in enumerate(ks):
        r.commit(k, ks[i - 1] if i else None)
    r.io.drain()
    assert r.on_ssd(ks) == [True, True, True]
    size = len(make_obj(ks[0], 1))
    assert r.bytes == [("ssd", "write", size)] * 3
    assert r.failures == []
    # no reference is left behind: every object can be deleted and its slot freed at once
    assert all(r.host.delete_sync(k) for k in ks)
    assert r.host.stats().bytes_used == 0


def test_write_back_holds_chunks_until_the_dirty_limit_then_writes_the_oldest(rig_factory):
    r = rig_factory("write_back", pages=16)
    size = len(make_obj(keys(1)[0], 1))
    assert r.writer.limit == int(16 * P * DIRTY_FRACTION)
    per_limit = r.writer.limit // size  # objects that fit under the limit
    ks = keys(per_limit + 1, seed=1)
    for k in ks[:per_limit]:
        r.commit(k)
    r.io.drain()
    assert r.on_ssd(ks[:per_limit]) == [False] * per_limit  # nothing written yet
    assert r.writer.dirty_bytes == per_limit * size
    r.commit(ks[per_limit])  # crosses the limit: flush down to half of it, oldest first
    r.io.drain()
    flushed = r.on_ssd(ks)
    n = sum(flushed)
    assert flushed == [True] * n + [False] * (len(ks) - n)
    assert r.writer.dirty_bytes == (len(ks) - n) * size <= r.writer.limit // 2
    r.writer.flush_all()
    assert r.on_ssd(ks) == [True] * len(ks)
    assert r.writer.dirty_bytes == 0
    assert all(r.host.delete_sync(k) for k in ks) and r.host.stats().bytes_used == 0


def test_dirty_chunks_are_never_evicted_unwritten(rig_factory):
    r = rig_factory("write_back", pages=8)
    ks = keys(4, seed=2)
    for k in ks[:3]:  # 3 of 8 units: under the limit of 4, all dirty and referenced
        r.commit(k)
    # a 6-unit put needs room that only evicting a dirty chunk could give: refused
    big = keys(1, seed=3)[0]
    assert r.host.put_start_sync(big, len(make_obj(big, 6))) is None
    r.writer.flush_all()  # written down and released: now evictable
    handle = r.host.put_start_sync(big, len(make_obj(big, 6)))
    assert handle is not None
    assert r.host.put_commit_sync(handle, ok=False) is False


def test_a_failing_lower_tier_is_counted_and_keeps_the_host_copy(rig_factory):
    r = rig_factory("write_through", ssd_capacity=1000)  # smaller than one object
    k = keys(1, seed=4)[0]
    r.commit(k)
    r.io.drain()
    assert r.failures and r.failures[0][0] == "ssd"
    assert r.on_ssd([k]) == [False]
    assert r.host.contains_sync(k) and r.host.delete_sync(k)
    assert r.host.stats().bytes_used == 0  # the write's reference was released


async def test_store_lookup_asks_each_tier_once_in_a_batch(tmp_path):
    host, ssd = HostTier(16 * P, pin=False), SSDTier(tmp_path / "ssd", 1 << 20)
    store = TieredStore(host, [ssd])
    ks = keys(5, seed=5)
    for k in ks[:2]:
        obj = make_obj(k, 1)
        h = host.put_start_sync(k, len(obj))
        h.buffer[:] = obj
        assert host.put_commit_sync(h)
    for k in (ks[2], ks[4]):
        from tiers.base import put_bytes

        await put_bytes(ssd, k, memoryview(make_obj(k, 1)))
    found = await store.lookup(ks)
    assert found.tiers == ("host", "host", "ssd")
    assert await store.present(ks) == [True, True, True, False, True]
    await store.aclose()


def test_unreachable_store_process_fails_start_or_is_left_out(tmp_path):
    port = free_port()  # nothing listens there
    io = IOLoop()
    try:
        strict = ConnectorConfig.from_extra_config({"store_target": f"127.0.0.1:{port}"}, env={})
        with pytest.raises(TierUnavailableError):
            io.run(open_lower_tiers(strict, lambda *a: None))
        failures = []
        lax = ConnectorConfig.from_extra_config(
            {"store_target": f"127.0.0.1:{port}", "ssd_dir": str(tmp_path / "ssd"),
             "lower_tiers_required": "false"}, env={})
        tiers = io.run(open_lower_tiers(lax, lambda *a: failures.append(a)))
        assert [t.name for t in tiers] == ["ssd"]
        assert failures == [("remote", "open")]
        for t in tiers:
            io.run(t.aclose())
    finally:
        io.close()
