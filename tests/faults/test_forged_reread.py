"""A read refused by its MAC is checked once more before the object is removed (the store
core's ``Promoter.refuse``), on a real SSD directory and a real host pool.

``TornReads`` is a real ``SSDTier`` whose first read of a key lands one changed byte in the
caller's buffer after the tier's own checks: what bytes changed while being read look like
to the MAC check.  Such a read is a miss (nothing wrong is published), counted as
``forged_reread``, and the object stays on SSD: the next read serves it.  A file that is
damaged on disk fails both reads: counted as ``forged`` and removed.  Costs under 1 s.
"""

from __future__ import annotations

from kvstore import codec, integrity
from kvstore.config import WritePolicy
from kvstore.store.tiered import TieredStore
from tests.kits.chain import keys_of, namespace, sealed
from tiers.base import PutResult, put_bytes
from tiers.host import HostTier
from tiers.ssd import SSDTier

NS = namespace("forged-reread")
SIZE = 64 * 1024


class TornReads(SSDTier):
    """An SSD tier whose first read of each key changes one payload byte in the buffer."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.torn: set = set()

    async def read_into(self, key, buf):
        n = await super().read_into(key, buf)
        if n and key not in self.torn:
            self.torn.add(key)
            buf[codec.HEADER_SIZE + 7] ^= 0x01
        return n


async def _store(tmp_path) -> TieredStore:
    ring = integrity.new_deployment().keyring(integrity.DEFAULT_TENANT)
    ssd = TornReads(tmp_path / "ssd", 1 << 22, name="ssd")
    return TieredStore(HostTier(64 * 4096, pin=False), [ssd], WritePolicy.WRITE_THROUGH, keys=lambda _k: ring)


def _publish(store: TieredStore, key, seed: int) -> bytes:
    obj = sealed(key, SIZE, seed)
    handle = store.host.put_start_sync(key, SIZE)
    handle.buffer[:] = obj
    store.seal(key, handle.buffer)
    assert store.host.put_commit_sync(handle)
    store.written(key, None)
    out = bytearray(SIZE)
    store.host.read_into_sync(key, out)
    return bytes(out)


async def test_a_read_whose_bytes_changed_is_a_miss_and_the_object_is_kept(tmp_path):
    store = await _store(tmp_path)
    ssd = store.lower[0]
    honest, damaged = keys_of(NS, 2)
    try:
        want = _publish(store, honest, 1)
        _publish(store, damaged, 2)
        assert await store.drain(10)
        for key in (honest, damaged):
            assert store.host.delete_sync(key)
        # the damaged object changes on disk too (checksum made valid, MAC not): a forgery
        data = bytearray(await _read(ssd, damaged))
        header = codec.decode_header(data)
        data[codec.HEADER_SIZE + 100] ^= 0x55
        codec.encode_into(data, header.key, header.geometry, None, header.parent)
        codec.set_mac(data, header.key_id, header.mac)
        await ssd.delete(damaged)
        assert await put_bytes(ssd, damaged, bytes(data)) is PutResult.STORED
        ssd.torn.discard(damaged)

        assert await store.promote(honest) is None  # the first read was torn: a miss
        assert store.counters.forged_reread == {"ssd": 1} and store.counters.forged == {}
        assert await ssd.present([honest]) == [True]  # kept
        assert await store.promote(honest) == "ssd"  # and served on the next read
        got = bytearray(SIZE)
        store.host.read_into_sync(honest, got)
        assert bytes(got) == want

        assert await store.promote(damaged) is None
        assert store.counters.forged == {"ssd": 1} and store.counters.forged_reread == {"ssd": 1}
        assert await ssd.present([damaged]) == [False]  # removed
    finally:
        await store.aclose(2)


async def _read(ssd: SSDTier, key) -> bytes:
    buf = memoryview(bytearray(await ssd.size_of(key)))
    n = await ssd.read_into(key, buf)
    return bytes(buf[:n])
