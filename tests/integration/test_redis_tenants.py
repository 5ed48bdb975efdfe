"""Redis as a tier shared by tenants who must not poison or empty each other's objects
(issue 22), against a real ``redis-server``:

* each tenant connects as its own Redis ACL user whose keys are ``~<prefix><tenant>:*``
  (``kvstore redis-acl`` prints the commands); the tier's every key lies under its
  ``key_prefix``, so tenant b's credentials can neither write, read nor delete under a's;
* with ``maxmemory-policy noeviction`` tenant b filling Redis gets its own writes refused
  (counted put failures) and evicts none of a's objects; under ``allkeys-lru`` the same
  writes empty a, which is why the tier warns at connect when the policy evicts.

Cost: about 3 s.
"""

from __future__ import annotations

import logging

from kvstore.cli.redis_acl import acl_commands
from tests.kits import chain as kv
from tiers.base import PutResult, put_bytes
from tiers.redis import RedisTier
from tiers.redis_config import RedisConfig

PART = 64 << 10
NS_A, NS_B = kv.namespace("tenant-a"), kv.namespace("tenant-b")


def make_users(server) -> dict[str, str]:
    """ACL users per tenant, made with the commands ``kvstore redis-acl`` prints."""
    admin = server.client()
    passwords = {}
    for tenant in ("a", "b"):
        commands, passwords[tenant] = acl_commands(tenant, "kvstore:", password=f"pw-{tenant}-0123456789abcdef")
        for command in commands:
            admin.execute_command(*command)
    return passwords


async def tenant_tier(server, user: str, password: str, prefix: str) -> RedisTier:
    url = f"redis://kvstore-{user}:{password}@{server.host}:{server.port}/0"
    return await RedisTier.open(RedisConfig.from_url(url, key_prefix=prefix, part_size=PART))


async def test_a_tenants_credentials_cannot_write_read_or_delete_under_another_prefix(redis_server):
    pw = make_users(redis_server)
    a = await tenant_tier(redis_server, "a", pw["a"], "kvstore:a:")
    mine = kv.keys_of(NS_A, 3)
    objects = {k: kv.make_object(k, 3 * PART + 5) for k in mine}
    for k, obj in objects.items():
        assert await put_bytes(a, k, obj) is PutResult.STORED
    # Tenant b points its tier at a's prefix, with its own credentials.
    b_on_a = await tenant_tier(redis_server, "b", pw["b"], "kvstore:a:")
    other = kv.keys_of(NS_A, 1, seed=9)[0]
    assert await put_bytes(b_on_a, other, kv.make_object(other, 4096)) is not PutResult.STORED
    assert b_on_a.stats().put_failures == 1
    assert await b_on_a.sizes(mine) == [None] * 3  # cannot even see them
    await b_on_a.delete(mine[0])
    assert (await b_on_a.lookup(mine)) == 0
    # a's objects are all there, byte for byte.
    for k, obj in objects.items():
        buf = bytearray(len(obj))
        assert await a.read_into(k, buf) == len(obj) and bytes(buf) == obj.tobytes()
    # b under its own prefix works.
    b = await tenant_tier(redis_server, "b", pw["b"], "kvstore:b:")
    k = kv.keys_of(NS_B, 1)[0]
    assert await put_bytes(b, k, kv.make_object(k, 1000)) is PutResult.STORED
    # And the admin view agrees: nothing of b's under a's prefix.
    names = [n.decode() for n in redis_server.client().keys("kvstore:*")]
    assert names and all(n.startswith(("kvstore:a:", "kvstore:b:")) for n in names)
    assert sum(n.startswith("kvstore:b:") for n in names) >= 1
    for t in (a, b_on_a, b):
        await t.aclose()


async def fill(tier: RedisTier, ns, n: int, size: int) -> list[PutResult]:
    out = []
    for k in kv.keys_of(ns, n, seed=5):
        out.append(await put_bytes(tier, k, kv.make_object(k, size)))
    return out


async def test_under_noeviction_one_tenants_writes_never_evict_anothers(redis_factory, caplog):
    server = redis_factory(maxmemory="8mb", maxmemory_policy="noeviction")
    pw = make_users(server)
    a = await tenant_tier(server, "a", pw["a"], "kvstore:a:")
    assert "evicts" not in caplog.text  # noeviction: no warning
    held = await fill(a, NS_A, 16, 64 << 10)
    assert held == [PutResult.STORED] * 16
    b = await tenant_tier(server, "b", pw["b"], "kvstore:b:")
    results = await fill(b, NS_B, 400, 64 << 10)  # 25 MiB into 8 MiB
    assert PutResult.STORED in results and any(r is not PutResult.STORED for r in results)
    assert b.stats().put_failures > 0  # refused, counted
    assert await a.lookup(kv.keys_of(NS_A, 16, seed=5)) == 16  # a lost nothing
    for t in (a, b):
        await t.aclose()


async def test_an_evicting_policy_is_warned_about_and_does_empty_the_other_tenant(redis_factory, caplog):
    server = redis_factory(maxmemory="8mb", maxmemory_policy="allkeys-lru")
    pw = make_users(server)
    with caplog.at_level(logging.WARNING):
        a = await tenant_tier(server, "a", pw["a"], "kvstore:a:")
    assert "allkeys-lru" in caplog.text and "noeviction" in caplog.text
    assert await fill(a, NS_A, 16, 64 << 10) == [PutResult.STORED] * 16
    b = await tenant_tier(server, "b", pw["b"], "kvstore:b:")
    await fill(b, NS_B, 400, 64 << 10)
    assert await a.lookup(kv.keys_of(NS_A, 16, seed=5)) < 16  # the attack the warning is about
    for t in (a, b):
        await t.aclose()


async def test_the_redis_acl_command_as_an_operator_scripts_it(redis_server, tmp_path):
    """``kvstore redis-acl`` prints commands holding no password, keeps the passwords in 0600
    files, and the URL it prints (password_file) opens the tenant's tier."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvstore",
            "redis-acl",
            "--dir",
            str(tmp_path / "acl"),
            "--tenant",
            "a",
            "--tenant",
            "b",
            "--redis",
            f"{redis_server.host}:{redis_server.port}",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    files = {t: tmp_path / "acl" / f"redis-{t}.password" for t in "ab"}
    for f in files.values():
        assert os.stat(f).st_mode & 0o777 == 0o600 and f.read_text().strip() not in out
    admin = redis_server.client()
    lines = out.strip().split("\n")
    for line in lines:
        if not line.startswith("#"):
            admin.execute_command(*line.split())
    url = next(x[2:] for x in lines if x.startswith("# redis://kvstore-a@"))
    tier = await RedisTier.open(RedisConfig.from_url(url, part_size=PART))
    k = kv.keys_of(NS_A, 1, seed=3)[0]
    assert tier.cfg.key_prefix == "kvstore:a:"
    assert await put_bytes(tier, k, kv.make_object(k, 2000)) is PutResult.STORED
    await tier.aclose()
    again = subprocess.run(
        [sys.executable, "-m", "kvstore", "redis-acl", "--dir", str(tmp_path / "acl"), "--tenant", "a"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert again.split("\n")[0] == lines[0]  # a rerun keeps the password
