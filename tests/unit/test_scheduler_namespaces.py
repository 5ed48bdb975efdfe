"""The scheduler half's namespace cache is bounded: a service with a ``cache_salt`` per user
must not grow the scheduler without bound, and a dropped namespace is only recomputed,
never wrong.  A real ``SchedulerHalf`` over a real (small) shared-memory host pool.
"""

from __future__ import annotations

import numpy as np
import pytest

from connector.config import ConnectorConfig
from connector.scheduler import NAMESPACE_CACHE, RequestView, SchedulerHalf
from kvstore.keys import Identity, chunk_hashes, object_keys

IDENT = Identity("ns-model", "r1", "bfloat16", "cpu:bs128:h2x16", 2, 2, 16, weights="w" * 32, engine_config="e" * 32)
PAGE_BYTES = 2 * 128 * 2 * 16 * 2  # heads x block x (K+V) x head_dim x bf16


@pytest.fixture
def sched():
    half = SchedulerHalf(ConnectorConfig.from_extra_config({"host_capacity": "8MiB"}, env={}), IDENT, PAGE_BYTES, 128)
    yield half
    half.close()


def expected(salt: str, lora: str = ""):
    return Identity(
        **{**{f: getattr(IDENT, f) for f in IDENT.__dataclass_fields__}, "scope": salt, "adapter": lora}
    ).namespace()


def test_many_salts_keep_at_most_the_capacity_and_each_namespace_is_right(sched):
    for i in range(NAMESPACE_CACHE + 100):
        assert sched.admission.namespace(f"user-{i}", "") == expected(f"user-{i}")
        assert len(sched.admission.namespaces) <= NAMESPACE_CACHE
    assert len(sched.admission.namespaces) == NAMESPACE_CACHE
    assert ("user-0", "", sched.epoch.current) not in sched.admission.namespaces  # the oldest went first
    assert sched.admission.namespace("user-0", "") == expected("user-0")  # recomputed, the same bytes
    assert len(sched.admission.namespaces) == NAMESPACE_CACHE


def test_a_salt_in_use_survives_while_idle_ones_are_dropped(sched):
    """Touched (a hit, not a re-insert) every half capacity: the very same entry stays."""
    hot = sched.admission.namespace("hot", "lora-a")
    for i in range(3 * NAMESPACE_CACHE):
        if i % (NAMESPACE_CACHE // 2) == 0:
            assert sched.admission.namespace("hot", "lora-a") is hot  # still cached, never recomputed
        sched.admission.namespace(f"user-{i}", "")
    assert sched.admission.namespaces[("hot", "lora-a", sched.epoch.current)] is hot
    assert hot == expected("hot", "lora-a") != expected("hot")


def test_requests_of_a_dropped_salt_get_the_keys_they_had(sched):
    """End to end through a lookup: the keys of salt "user-0" after its namespace was
    evicted equal the keys computed before (and a direct computation)."""
    tokens = list(range(1000, 1000 + 300))
    sched.matched_tokens(RequestView("first", tokens, salt="user-0"), 0)
    before = sched._reqs["first"].keys
    for i in range(1, NAMESPACE_CACHE + 10):
        sched.admission.namespace(f"user-{i}", "")
    assert ("user-0", "", sched.epoch.current) not in sched.admission.namespaces
    sched.matched_tokens(RequestView("again", tokens, salt="user-0"), 0)
    ns = expected("user-0")
    assert sched._reqs["again"].keys == before == object_keys(ns, chunk_hashes(ns, np.asarray(tokens), 256))
