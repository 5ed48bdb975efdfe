"""``kvstore redis-acl``: one Redis ACL user per tenant of a shared Redis tier, so that no
tenant's credentials can write, read, delete or evict under another tenant's keys.

    kvstore redis-acl --dir /run/kvstore --tenant a --tenant b [--prefix kvstore:]

For each tenant it writes ``DIR/redis-<tenant>.password`` (mode 0600, 32 random bytes hex;
kept when it exists, so a rerun prints the same users) and prints, one per line, the
``ACL SETUSER`` command to give Redis (``redis-cli < file``), holding only the password's
sha256 (``#<hex>``), never the password, and the URL of the tenant's tier::

    redis://kvstore-a@HOST:6379/0?key_prefix=kvstore:a:&password_file=/run/kvstore/redis-a.password

The user ``kvstore-<tenant>`` may touch only keys ``<prefix><tenant>:*`` (every key of the
tier lies under its ``key_prefix``), with only the commands the tier sends.  Run that Redis
with ``maxmemory-policy noeviction``: its own eviction cannot be partitioned by tenant (the
tier warns at connect when the policy evicts).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

from kvstore.cli.tokens import _write_private
from kvstore.errors import ConfigError

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# What the Redis tier sends (tiers/redis*.py): reads, pipelined writes, TTLs, the delete-if-same
# script, the budget's scripts and sweep (tiers.redis_budget: a counter, a hash and a sorted set),
# the connection handshake, INFO (its eviction policy), and a cluster's slot map.
COMMANDS = (
    "get",
    "set",
    "mget",
    "setrange",
    "getrange",
    "strlen",
    "exists",
    "pexpire",
    "persist",
    "unlink",
    "del",
    "eval",
    "evalsha",
    "incr",
    "incrby",
    "time",
    "hget",
    "hset",
    "hdel",
    "hexists",
    "hgetall",
    "zadd",
    "zrange",
    "zrem",
    "zscore",
    "zcard",
    "scan",
    "ping",
    "echo",
    "info",
    "hello",
    "auth",
    "select",
    "readonly",
    "multi",
    "exec",
    "discard",
    "client|setname",
    "cluster|slots",
    "cluster|shards",
    "cluster|nodes",
    "cluster|info",
    "command|docs",
    "command|info",
)


def acl_commands(tenant: str, prefix: str = "kvstore:", password: str | None = None) -> tuple[list[list[str]], str]:
    """The commands that make tenant ``tenant``'s user, and its password (new if None)."""
    if not _TENANT.match(tenant):
        raise ConfigError(f"--tenant {tenant!r}: 1-64 characters of [A-Za-z0-9_.-]")
    if not prefix or any(c.isspace() or c in "*?[]{}" for c in prefix):
        raise ConfigError(f"--prefix {prefix!r}: no spaces, glob characters or hash tags")
    password = password or secrets.token_hex(32)
    digest = hashlib.sha256(password.encode()).hexdigest()
    command = [
        "ACL",
        "SETUSER",
        f"kvstore-{tenant}",
        "reset",
        "on",
        f"#{digest}",
        f"~{prefix}{tenant}:*",
        "resetchannels",
        "-@all",
        *(f"+{c}" for c in COMMANDS),
    ]
    return [command], password


def register(sub) -> None:
    p = sub.add_parser("redis-acl", help="Redis ACL users, one per tenant of a shared Redis tier")
    p.add_argument("--dir", required=True, help="where redis-<tenant>.password go (created 0700)")
    p.add_argument("--tenant", action="append", required=True, help="a tenant; repeatable")
    p.add_argument("--prefix", default="kvstore:", help="the tier's key prefix before the tenant (kvstore:)")
    p.add_argument("--redis", default="HOST:6379", help="HOST:PORT to show in the URLs")
    p.set_defaults(func=_run)


def _run(args) -> int:
    directory = Path(args.dir)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for tenant in args.tenant:
        acl_commands(tenant, args.prefix)  # check before writing anything
    for tenant in args.tenant:
        path = directory / f"redis-{tenant}.password"
        password = path.read_text().strip() if path.exists() else None
        commands, password = acl_commands(tenant, args.prefix, password)
        _write_private(path, password + "\n")
        for command in commands:
            print(" ".join(command))
        print(
            f"# redis://kvstore-{tenant}@{args.redis}/0?key_prefix={args.prefix}{tenant}:"
            f"&password_file={path.resolve()}"
        )
    return 0


__all__ = ["COMMANDS", "acl_commands"]
