"""The ``Tier`` protocol's batch questions (``tiers.base``): ``TierBase``'s defaults for a
backend with nothing better (``sizes`` from ``size_of``, ``present`` from ``sizes``,
``lookup`` from ``present``), and the same answers from the real tiers that batch them."""

from __future__ import annotations

import pytest
from test_host_tier import P, make_obj  # noqa: E402 - shared object maker

from kvstore.keys import ObjectKey
from tests.kits.chain import keys_of, namespace
from tiers.base import Tier, TierBase, put_bytes
from tiers.host import HostTier
from tiers.ssd import SSDTier

NS = namespace("tier-base")
KS = keys_of(NS, 5)
HELD = {KS[0]: 100, KS[1]: 200, KS[3]: 400}  # a gap at 2: per key, 3 is still present


class SizesOnly(TierBase):
    """The least a backend can offer: ``size_of`` alone (it counts the calls)."""

    name = "sizes-only"

    def __init__(self, held: dict[ObjectKey, int]) -> None:
        self.held, self.calls = held, 0

    async def size_of(self, key: ObjectKey) -> int | None:
        self.calls += 1
        return self.held.get(key)


async def test_defaults_answer_per_key_and_the_prefix_from_size_of():
    tier = SizesOnly(HELD)
    assert await tier.sizes(KS) == [100, 200, None, 400, None] and tier.calls == 5
    assert await tier.present(KS) == [True, True, False, True, False]
    assert await tier.lookup(KS) == 2 and await tier.lookup(KS[3:4]) == 1 and await tier.lookup([]) == 0
    assert await tier.contains(KS[3]) and not await tier.contains(KS[2])


async def test_a_base_without_size_of_is_not_a_backend():
    with pytest.raises(NotImplementedError):
        await TierBase().size_of(KS[0])


@pytest.fixture
async def real_tiers(tmp_path):
    host = HostTier(16 * P, pin=False)
    ssd = SSDTier(tmp_path / "ssd", 1 << 20, fsync=False)
    for tier in (host, ssd):
        for k in (KS[0], KS[1], KS[3]):
            await put_bytes(tier, k, memoryview(make_obj(k, 1)))
    yield host, ssd
    await ssd.aclose()
    host.close()


async def test_real_tiers_give_the_same_per_key_answers(real_tiers):
    size = len(make_obj(KS[0], 1))
    for tier in real_tiers:
        assert isinstance(tier, Tier) and isinstance(tier, TierBase)
        assert await tier.sizes(KS) == [size, size, None, size, None]
        assert await tier.present(KS) == [True, True, False, True, False]
        assert await tier.lookup(KS) == 2
        assert await tier.contains(KS[3]) and not await tier.contains(KS[4])
