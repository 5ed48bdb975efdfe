"""``kvstore tokens``: generate a tokens file for ``kvstore serve --auth-tokens`` and one
token file per tenant for its clients.

    kvstore tokens --dir /run/kvstore --tenant engine=read,write,shm --tenant ops=read,admin

writes ``DIR/tokens.yaml`` (mode 0600: each token only as its sha256 digest, so the server's
file holds no secret) and ``DIR/<tenant>.token`` (mode 0600: the token itself, for
``--store-token-file`` / ``--token-file``).  Tokens are 32 random bytes (``secrets``), hex.
An existing ``tokens.yaml`` is kept as it is (a restart keeps its tokens) unless ``--force``.
Nothing is printed but the paths written.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from pathlib import Path

import yaml

from kvstore.errors import ConfigError

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_PERMISSIONS = {"read", "write", "shm", "admin"}


def register(sub) -> None:
    p = sub.add_parser("tokens", help="generate a tokens file and per-tenant token files")
    p.add_argument("--dir", required=True, help="where tokens.yaml and <tenant>.token go (created 0700)")
    p.add_argument(
        "--tenant",
        action="append",
        required=True,
        metavar="NAME=PERM,PERM",
        help="a tenant and its token's permissions (read, write, shm, admin); repeatable",
    )
    p.add_argument("--force", action="store_true", help="replace an existing tokens.yaml")
    p.set_defaults(func=_run)


def parse_tenant(text: str) -> tuple[str, list[str]]:
    name, sep, perms = text.partition("=")
    chosen = [p.strip() for p in perms.split(",") if p.strip()]
    if not sep or not _TENANT.match(name) or not chosen or set(chosen) - _PERMISSIONS:
        raise ConfigError(
            f"--tenant {text!r}: expected NAME=PERM[,PERM...] with PERM one of {', '.join(sorted(_PERMISSIONS))}"
        )
    return name, chosen


def generate(directory: Path, tenants: list[tuple[str, list[str]]], force: bool = False) -> list[Path]:
    """Write the files (see the module docstring); the paths written (none when kept)."""
    table = directory / "tokens.yaml"
    if table.exists() and not force:
        return []
    if len({name for name, _ in tenants}) != len(tenants):
        raise ConfigError("--tenant: each tenant once")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    entries, written = [], []
    for name, perms in tenants:
        token = secrets.token_hex(32)
        entries.append({"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": name, "permissions": perms})
        written.append(_write_private(directory / f"{name}.token", token + "\n"))
    written.insert(0, _write_private(table, yaml.safe_dump({"tokens": entries}, sort_keys=False)))
    return written


def _write_private(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def _run(args) -> int:
    written = generate(Path(args.dir), [parse_tenant(t) for t in args.tenant], args.force)
    for path in written:
        print(path)
    if not written:
        print(f"{Path(args.dir) / 'tokens.yaml'} exists: kept (--force replaces it)")
    return 0


__all__ = ["generate", "parse_tenant", "register"]
