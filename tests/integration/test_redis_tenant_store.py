"""A real ``kvstore serve`` whose tenants share one real ``redis-server`` (``noeviction``):
the store connects to Redis as each tenant's ACL user (a ``--redis`` URL with ``{tenant}``,
``kvstore.server.redis_tenants``) and keeps each tenant within its ``redis_bytes``:

* tenant b writing far beyond its budget evicts none of a's objects; after a restart of the
  store a finds every one of them in Redis, byte for byte; b's bytes, read straight from
  Redis, stay within its budget; an object larger than b's budget is refused and counted;
* ``CLIENT LIST`` shows the store's connections as users kvstore-a and kvstore-b, and
  those users cannot touch the other tenant's prefix (NOPERM).

Cost: about 8 s (two store starts).
"""

from __future__ import annotations

import os
import re
import urllib.request

import numpy as np
import pytest
import redis

from kvstore._proto import kvstore_pb2 as pb
from kvstore.cli.redis_acl import acl_commands
from kvstore.testing.serve_proc import StoreProcess
from tests.kits.store_calls import KiB, MiB, Objects, StoreClient, random_key, wait_until, write_tokens

TOKENS = [
    {"token": "tok-a", "tenant": "a", "permissions": ["read", "write"]},
    {"token": "tok-b", "tenant": "b", "permissions": ["read", "write"]},
]
BUDGET_B = 1 * MiB
SIZE = 64 * KiB


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(redis server, work dir, store args): users and 0600 password files per tenant."""
    from kvstore.testing.redis_proc import RedisServer

    work = tmp_path_factory.mktemp("tenant-redis")
    server = RedisServer(work / "redis", maxmemory="64mb", maxmemory_policy="noeviction")
    server.start()
    admin = server.client()
    for tenant in "ab":
        commands, password = acl_commands(tenant, "kvstore:")
        for command in commands:
            admin.execute_command(*command)
        path = work / f"redis-{tenant}.password"
        path.write_text(password + "\n")
        os.chmod(path, 0o600)
    tokens = write_tokens(work / "tokens.yaml", TOKENS)
    text = tokens.read_text() + f"tenants:\n  a: {{redis_bytes: 4MiB}}\n  b: {{redis_bytes: {BUDGET_B}}}\n"
    tokens.write_text(text)
    url = (
        f"redis://kvstore-{{tenant}}@{server.host}:{server.port}/0?key_prefix=kvstore:{{tenant}}:"
        f"&password_file={work}/redis-{{tenant}}.password"
    )
    args = ("--host-capacity", "32MiB", "--auth-tokens", str(tokens), "--redis", url)
    yield server, work, args
    server.stop()


def under(server, prefix: str, kind: str) -> list[bytes]:
    return list(server.client().scan_iter(match=f"{prefix}{kind}*"))


def data_bytes(server, prefix: str) -> int:
    admin = server.client()
    return sum(admin.strlen(n) for kind in ("i:", "p:", "m:") for n in under(server, prefix, kind))


def redis_doc(c: StoreClient) -> dict:
    """The tenant's own Redis counters in ``Stats`` (all a tenant's token sees)."""
    doc = c.stats()[0]
    return {**doc["tiers"].get("redis", {}), "refused": doc["refused"].get("redis_bytes", 0)}


def test_a_tenant_over_its_budget_never_evicts_another_and_the_store_uses_each_users(setup):
    server, work, args = setup
    objects, rng = Objects(2 * MiB), np.random.default_rng(7)
    mine, theirs = [random_key(rng) for _ in range(6)], [random_key(rng) for _ in range(48)]
    with (
        StoreProcess(work / "one", *args, "--metrics-port", "0") as proc,
        StoreClient(proc.target, "tok-a") as a,
        StoreClient(proc.target, "tok-b") as b,
    ):
        for i, key in enumerate(mine):
            assert a.put_stream(key, objects.make(key, SIZE, seed=i)) == pb.PUT_OUTCOME_STORED
        assert wait_until(lambda: redis_doc(a).get("puts") == 6)
        for i, key in enumerate(theirs):  # 3 MiB into a 1 MiB budget
            assert b.put_stream(key, objects.make(key, SIZE, seed=i)) == pb.PUT_OUTCOME_STORED
        big = random_key(rng)
        assert b.put_stream(big, objects.make(big, 2 * MiB)) == pb.PUT_OUTCOME_STORED  # host only
        assert wait_until(lambda: redis_doc(b).get("puts") == 48 and redis_doc(b)["refused"] == 1)
        doc = redis_doc(b)
        assert doc["evictions"] > 0 and doc["capacity_bytes"] == BUDGET_B and doc["key_prefix"] == "kvstore:b:"
        assert redis_doc(a)["evictions"] == 0
        with urllib.request.urlopen(proc.metrics_url, timeout=10) as reply:
            scraped = reply.read().decode()
        assert 'tenant_refused_total{tenant="b",what="redis_bytes"} 1.0' in scraped
        evicted = re.search(r'tenant_evictions_total\{tenant="b",tier="redis"\} (\d+)', scraped)
        assert evicted and int(evicted.group(1)) == doc["evictions"] > 0
        users = [c["user"] for c in server.client().client_list()]  # CLIENT LIST's user= field
        assert {u for u in users if u != "default"} == {"kvstore-a", "kvstore-b"}
    assert len(under(server, "kvstore:a:", "m:")) == 6  # a lost nothing
    assert 0 < data_bytes(server, "kvstore:b:") <= BUDGET_B  # measured from outside
    out = np.zeros(2 * MiB, np.uint8)
    with StoreProcess(work / "two", *args) as proc, StoreClient(proc.target, "tok-a") as a:
        assert [list(a.lookup([key]).tiers) for key in mine] == [[pb.TIER_REDIS]] * 6
        for i, key in enumerate(mine):
            assert a.get_stream(key, out) == SIZE
            assert bytes(out[:SIZE]) == bytes(objects.make(key, SIZE, seed=i))


def test_each_tenants_redis_user_cannot_touch_the_other_prefix(setup):
    server, work, _ = setup
    for me, other in (("a", "b"), ("b", "a")):
        password = (work / f"redis-{me}.password").read_text().strip()
        conn = redis.Redis(host=server.host, port=server.port, username=f"kvstore-{me}", password=password)
        conn.set(f"kvstore:{me}:probe", b"x")
        for attempt in (
            lambda: conn.set(f"kvstore:{other}:probe", b"x"),
            lambda: conn.get(f"kvstore:{other}:m:anything"),
            lambda: conn.unlink(f"kvstore:{other}:m:anything"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        conn.delete(f"kvstore:{me}:probe")
        conn.close()
