"""Bearer-token authentication of the store process (server side; docs/architecture.md#tenancy).

* A tokens file is YAML::

      tokens:
        - {token: "s3cret-a", tenant: "a", permissions: [read, write, shm]}
        - {token_file: /run/secrets/a-read, tenant: "a", permissions: [read]}
        - {token_env: KVSTORE_OPS_TOKEN, tenant: "ops", permissions: [read, admin]}
        - {sha256: "9f86d0...", tenant: "b", permissions: [read, write]}
      tenants:                      # optional quotas (kvstore.server.tenants)
        a: {host_bytes: 256MiB, leases: 1024}

  Each entry gives its token one way: inline (``token``), from a file (``token_file``:
  its first line), from an environment variable (``token_env``), or only its sha256 digest
  in hex (``sha256``, so the file holds no secret).  ``TokenTable.load(path)`` checks it
  whole before the server starts: a missing or unreadable file, bad YAML, an entry that is
  not a mapping, an unknown key, no token or two ways of giving one, an empty token or
  tenant, a duplicate token, an empty or unknown permission all raise ``ConfigError``
  naming the file, the entry and the value (never the token itself: a duplicate is named
  by its entry numbers).
* Every RPC except health carries ``authorization: Bearer <token>``.  ``Authenticator``
  turns call metadata into a ``Principal`` (tenant + permissions): a missing, malformed or
  unknown token raises ``UnauthenticatedError``; ``Principal.require`` raises
  ``PermissionDeniedError`` naming the permission that is lacking.
* Permissions: ``read``, ``write``, ``shm`` (the shared-memory data plane) and ``admin``
  (``Stats`` of every tenant; without it ``Stats`` shows the caller's tenant only).
* Without a tokens file every call must carry the store's default token
  (``kvstore.localtoken``: a 0600 file of the store's user; ``Authenticator.local``) and
  is ``Principal("default", {read, write, shm, admin})``; with ``insecure`` and no tokens
  file no token is asked for (``Authenticator(None)``: everyone is that principal).
* Tokens are kept only as sha256 digests, so a lookup never compares secrets byte by byte
  and a memory dump does not reveal them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import yaml

from kvstore.config import read_token_file
from kvstore.errors import ConfigError, PermissionDeniedError, UnauthenticatedError
from kvstore.server.tenants import Limits, parse_limits

__all__ = ["PermissionDeniedError", "UnauthenticatedError"]  # re-exported for the server
log = logging.getLogger("kvstore.server")


class Permission(Enum):
    READ = "read"  # Lookup, Get, GetStream, Stats
    WRITE = "write"  # PutStart, PutCommit, PutStream, Delete
    SHM = "shm"  # the shared-memory data plane: segment offsets (Get, PutStart)
    ADMIN = "admin"  # Stats of every tenant (without it: the caller's tenant only)


ALL_PERMISSIONS = frozenset(Permission)
DEFAULT_TENANT = "default"
_SOURCES = ("token", "token_file", "token_env", "sha256")
_ENTRY_KEYS = frozenset({*_SOURCES, "tenant", "permissions"})
_MAX_TENANT = 128


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant objects are scoped to, and what it may do."""

    tenant: str
    permissions: frozenset[Permission]

    def allows(self, permission: Permission) -> bool:
        return permission in self.permissions

    def require(self, *needed: Permission) -> None:
        missing = [p.value for p in needed if p not in self.permissions]
        if missing:
            raise PermissionDeniedError(f"tenant {self.tenant!r}: token lacks permission {', '.join(missing)}")

    @property
    def permission_names(self) -> list[str]:
        return [p.value for p in Permission if p in self.permissions]


ANONYMOUS = Principal(DEFAULT_TENANT, ALL_PERMISSIONS)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """Token digests mapped to principals (see the module docstring); ``limits`` are the
    tenants' quotas from the file's ``tenants`` section."""

    def __init__(self, principals: Mapping[bytes, Principal], limits: Mapping[str, Limits] | None = None) -> None:
        self._by_digest = dict(principals)
        self.limits = dict(limits or {})

    def __repr__(self) -> str:
        return f"TokenTable({len(self)} tokens, tenants {sorted(self.tenants)})"

    def principals(self) -> list[Principal]:
        return list(self._by_digest.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> set[str]:
        return {p.tenant for p in self._by_digest.values()}

    def principal(self, token: str) -> Principal | None:
        return self._by_digest.get(_digest(token))

    @classmethod
    def load(cls, path: str | Path) -> TokenTable:
        """Read and validate a tokens file; ``ConfigError`` naming the problem."""
        path = Path(path)
        try:
            text = path.read_text()
        except FileNotFoundError as err:
            raise ConfigError(f"auth tokens file {path} does not exist") from err
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"auth tokens file {path} is not readable: {err}") from err
        at = None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as err:  # its text quotes the line, which may hold a token: where only
            mark = getattr(err, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        if at is not None:  # raised outside the handler: no exception of yaml's rides along
            raise ConfigError(f"auth tokens file {path} is not valid YAML{at}")
        return cls.from_document(doc, str(path))

    @classmethod
    def from_document(cls, doc: object, where: str = "auth tokens", env: Mapping[str, str] | None = None) -> TokenTable:
        if not isinstance(doc, dict) or "tokens" not in doc or set(doc) - {"tokens", "tenants"}:
            raise ConfigError(
                f"{where}: expected a mapping with 'tokens' (and optionally 'tenants') "
                f"(tokens: [{{token, tenant, permissions}}, ...])"
            )
        entries = doc["tokens"]
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{where}: 'tokens' must be a non-empty list")
        table: dict[bytes, Principal] = {}
        first_seen: dict[bytes, int] = {}
        for i, entry in enumerate(entries):
            digest, principal = _parse_entry(entry, f"{where}: tokens[{i}]", os.environ if env is None else env)
            if digest in table:
                raise ConfigError(
                    f"{where}: tokens[{i}] repeats the token of "
                    f"tokens[{first_seen[digest]}] (each token must be unique)"
                )
            table[digest] = principal
            first_seen[digest] = i
        tenants = {p.tenant for p in table.values()}
        return cls(table, parse_limits(doc.get("tenants"), where, tenants))


def _parse_entry(entry: object, where: str, env: Mapping[str, str]) -> tuple[bytes, Principal]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with token, tenant, permissions; got a {type(entry).__name__}")
    unknown = sorted(map(str, set(entry) - _ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_ENTRY_KEYS))}")
    tenant, perms = entry.get("tenant"), entry.get("permissions")
    digest = _entry_digest(entry, where, env)
    if not isinstance(tenant, str) or not tenant.strip():
        raise ConfigError(f"{where}: 'tenant' must be a non-empty string, got {tenant!r}")
    if len(tenant) > _MAX_TENANT or not tenant.isprintable():
        raise ConfigError(f"{where}: tenant {tenant!r} must be 1-{_MAX_TENANT} printable characters")
    return digest, Principal(tenant, _parse_permissions(perms, where))


def _entry_digest(entry: dict, where: str, env: Mapping[str, str]) -> bytes:
    """The sha256 of the entry's token, from whichever one source it names."""
    given = [k for k in _SOURCES if k in entry]
    if len(given) != 1:
        raise ConfigError(
            f"{where}: give the token exactly one way ({', '.join(_SOURCES)}); got {', '.join(given) or 'none'}"
        )
    source, value = given[0], entry[given[0]]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {source!r} must be a non-empty string")
    if source == "sha256":
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ConfigError(f"{where}: 'sha256' must be 64 hex digits (the token's sha256)")
        return raw
    if source == "token":
        log.warning(
            "%s: an inline token: whoever reads this file (or the store's /proc/PID/cmdline, which names "
            "it) can use it; give only its digest instead (sha256: <hex of sha256(token)>; "
            "`kvstore tokens` writes such a file and each token to a 0600 file of its own)",
            where,
        )
    token = _token_from(source, value, where, env)
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ConfigError(f"{where}: the token must not contain spaces or control characters")
    return _digest(token)


def _token_from(source: str, value: str, where: str, env: Mapping[str, str]) -> str:
    if source == "token":
        return value
    if source == "token_env":
        if not env.get(value, "").strip():
            raise ConfigError(f"{where}: environment variable {value} (token_env) is unset or empty")
        return env[value].strip()
    try:
        token = read_token_file(value)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from err
    return token


def _parse_permissions(perms: object, where: str) -> frozenset[Permission]:
    if not isinstance(perms, list) or not perms:
        raise ConfigError(f"{where}: 'permissions' must be a non-empty list of read, write, shm, admin")
    out = set()
    for name in perms:
        try:
            out.add(Permission(name))
        except ValueError as err:
            raise ConfigError(f"{where}: unknown permission {name!r}; known: read, write, shm, admin") from err
    return frozenset(out)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the ``authorization: Bearer <token>`` entry; None when there is none.
    A present but malformed header raises ``UnauthenticatedError``."""
    for name, value in metadata or ():
        if name.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise UnauthenticatedError("authorization metadata must be 'Bearer <token>'")
        return token
    return None


class Authenticator:
    """Call metadata → ``Principal``; open (everyone is ANONYMOUS) without a table."""

    def __init__(self, table: TokenTable | None = None) -> None:
        self.table = table

    @classmethod
    def from_file(cls, path: str | Path | None) -> Authenticator:
        return cls(None if path is None else TokenTable.load(path))

    @classmethod
    def local(cls, token: str) -> Authenticator:
        """The default token (``kvstore.localtoken``) alone: tenant ``default``, every permission."""
        return cls(TokenTable({_digest(token): ANONYMOUS}))

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        if self.table is None:
            return ANONYMOUS
        token = bearer_token(metadata)
        if token is None:
            raise UnauthenticatedError("missing 'authorization: Bearer <token>' metadata")
        principal = self.table.principal(token)
        if principal is None:
            raise UnauthenticatedError("unknown bearer token")
        return principal


__all__ = [
    "ALL_PERMISSIONS",
    "ANONYMOUS",
    "Authenticator",
    "DEFAULT_TENANT",
    "Permission",
    "PermissionDeniedError",
    "Principal",
    "TokenTable",
    "UnauthenticatedError",
    "bearer_token",
]
