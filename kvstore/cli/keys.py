"""``kvstore keys``: the deployment secret of the objects' MACs, and tenant key files.

    kvstore keys create  --file /etc/kvstore/keys.json            # a new secret, key id 1
    kvstore keys rotate  --file /etc/kvstore/keys.json            # add id N+1 and seal with it
    kvstore keys retire  --file /etc/kvstore/keys.json --id 1     # objects of id 1 now refused
    kvstore keys export  --file /etc/kvstore/keys.json --tenant team-a --out team-a.keys
    kvstore keys show    --file /etc/kvstore/keys.json            # ids and the current one

Every file is written 0600 (a temporary file renamed).  ``create`` keeps an existing file
unless ``--force``.  ``export`` writes the tenant's derived keys only (an engine of that
tenant holds no other tenant's key and never the secret).  A rotation or retirement reaches
a running store or engine at its next start.  Secrets are never printed; see
docs/integrity.md.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from kvstore import integrity
from kvstore.cli.tokens import _TENANT
from kvstore.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("keys", help="make, rotate and retire the deployment secret of the objects' MACs")
    actions = p.add_subparsers(dest="action", required=True)
    for name, text in (
        ("create", "write a new deployment secret (key id 1)"),
        ("rotate", "add a new key id and make it current (old ids stay readable)"),
        ("retire", "remove a key id (objects sealed with it are refused)"),
        ("export", "write one tenant's derived keys for its engines"),
        ("show", "print the key ids and the current one"),
    ):
        a = actions.add_parser(name, help=text)
        a.add_argument("--file", required=True, help="the deployment secret file")
        if name == "create":
            a.add_argument("--force", action="store_true", help="replace an existing file")
        if name == "retire":
            a.add_argument("--id", type=int, required=True, help="the key id to retire")
        if name == "export":
            a.add_argument("--tenant", required=True, help="the tenant (`default` without a tokens file)")
            a.add_argument("--out", required=True, help="the tenant key file to write (0600)")
        a.set_defaults(func=_run)


def _deployment(path: Path) -> integrity.Deployment:
    source = integrity.read_file(path)
    if source.deployment is None:
        raise ConfigError(f"{path}: a tenant key file, not a deployment secret")
    return source.deployment


def create(path: Path, force: bool = False) -> bool:
    """A new deployment secret at ``path``; False when one exists (kept)."""
    if path.exists() and not force:
        return False
    integrity.write_private(path, integrity.dump(integrity.new_deployment()))
    return True


def rotate(path: Path) -> int:
    dep = _deployment(path)
    kid = max(dep.secrets) + 1
    if kid >= 1 << 16:
        raise ConfigError("no key id left (65535 used)")
    dep.secrets[kid] = secrets.token_bytes(integrity.KEY_SIZE)
    dep.current = kid
    integrity.write_private(path, integrity.dump(dep))
    return kid


def retire(path: Path, kid: int) -> None:
    dep = _deployment(path)
    if kid not in dep.secrets:
        raise ConfigError(f"{path}: no key id {kid} (ids: {sorted(dep.secrets)})")
    if kid == dep.current:
        raise ConfigError(f"key id {kid} is current: rotate first")
    del dep.secrets[kid]
    integrity.write_private(path, integrity.dump(dep))


def export(path: Path, tenant: str, out: Path) -> None:
    if not _TENANT.match(tenant):
        raise ConfigError(f"--tenant {tenant!r}: 1-64 of A-Z a-z 0-9 _ . -")
    integrity.write_private(out, integrity.dump(_deployment(path).keyring(tenant)))


def _run(args) -> int:
    path = Path(args.file)
    if args.action == "create":
        print(path if create(path, args.force) else f"{path} exists: kept (--force replaces it)")
    elif args.action == "rotate":
        print(f"key id {rotate(path)} is current")
    elif args.action == "retire":
        retire(path, args.id)
        print(f"key id {args.id} retired")
    elif args.action == "export":
        export(path, args.tenant, Path(args.out))
        print(args.out)
    else:
        dep = _deployment(path)
        print(f"key ids {sorted(dep.secrets)}, current {dep.current}")
    return 0


__all__ = ["create", "export", "register", "retire", "rotate"]
